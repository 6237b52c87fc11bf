"""Token-choice router: each token picks its top-k experts (ST-MoE, OpenMoE v1)."""
import dataclasses
from typing import Dict, Tuple

import gin
import jax
import jax.numpy as jnp

from openmoe_jax.moe import losses
from openmoe_jax.moe.gates import GateScores, scale
from openmoe_jax.moe.routers import (PRIORITIES, Routing, expert_capacity,
                                     token_stats, top_k_capacity_routing)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TokenChoiceRouter:
  """Top-k token choice with capacity (ST-MoE priority) or dropless.

  Called by the MoE layer with the shared settings of `MoeConfig` as arguments
  (`top_k`, the capacity factor of the phase, `min_capacity`, `renormalize_gates`,
  `routed_scaling_factor`; see `moe.layer.router_arguments`); its own fields:

  - `dropless`: no capacity; every choice is served (buffers hold a whole group).
    Either priority then gives the same output.
  - `priority`: the order in which choices claim expert buffer slots.
    "choice_major" (default; flaxformer, OpenMoE v1): all 1st choices of a group,
    in sequence order, before any 2nd choice. With top_k >= 2 and a finite
    capacity a later token's 1st choice can drop an earlier token's 2nd choice, so
    a decoder's output at position i depends on tokens after i (not causal).
    "position_major": tokens in sequence order, each token's choices in rank
    order; a token's service depends only on tokens before it in its group (the
    earlier rows of the group and the earlier positions of its own row): causal.
    Both are the same for top_k = 1. Pair position_major with enough capacity
    (`capacity_per_choice` or `dropless`): with ST-MoE capacity at top-2 the
    buffers fill before the end of the group and late tokens lose every choice.
  - `batch_prioritized`: within a choice rank, tokens with a higher top-1 score are
    served first (BPR, V-MoE). WARNING: a token's service then depends on later
    tokens of the group, which breaks causality in a decoder (train/inference
    mismatch); use it for encoders or ablations only. Only with "choice_major".
  - `jitter_noise`: multiplicative uniform noise x * U(1 - eps, 1 + eps) on the
    router inputs in training (applied by the MoE layer; needs the "jitter" rng).
  - `capacity_per_choice`: False (default, ST-MoE / flaxformer / OpenMoE v1):
    capacity = cf x T / E, so top-2 at cf 1.25 has buffers for 62.5% of the
    choices; True (Megatron, ColossalAI, OpenMoE 2): cf x k x T / E, buffers for cf
    times the average load of every choice (what fine-grained top-k needs).

  Gin: `MoeConfig.router = @TokenChoiceRouter()`, `TokenChoiceRouter.dropless = True`,
  `TokenChoiceRouter.priority = "position_major"`.
  """

  dropless: bool = False
  batch_prioritized: bool = False
  jitter_noise: float = 0.0
  capacity_per_choice: bool = False
  priority: str = "choice_major"

  def __post_init__(self):
    if self.priority not in PRIORITIES:
      raise ValueError(f"TokenChoiceRouter.priority={self.priority!r}; choose one of "
                       f"{PRIORITIES}")
    if self.batch_prioritized and self.priority == "position_major":
      raise ValueError("TokenChoiceRouter: batch_prioritized=True orders tokens by "
                       "score, which contradicts priority='position_major'; use one")

  def capacity(self, tokens_per_group: int, *, num_experts: int, top_k: int,
               capacity_factor: float, min_capacity: int) -> int:
    """Returns the per-expert buffer size for a group of `tokens_per_group` tokens."""
    if self.dropless:
      return tokens_per_group
    factor = capacity_factor * (top_k if self.capacity_per_choice else 1)
    return expert_capacity(tokens_per_group, num_experts, factor, min_capacity)

  def __call__(self, scores: GateScores, *, top_k: int, capacity_factor: float,
               min_capacity: int, renormalize: bool, scaling_factor: float,
               sequence_length: int) -> Tuple[Routing, Dict[str, jax.Array]]:
    """Returns (Routing with k = top_k, aux: stats and `lb_loss`) for the gate
    scores of groups [g, s, E] of sequences of `sequence_length` tokens."""
    _, s, num_experts = scores.scores.shape
    capacity = self.capacity(s, num_experts=num_experts, top_k=top_k,
                             capacity_factor=capacity_factor, min_capacity=min_capacity)
    routing = top_k_capacity_routing(scores.scores, top_k, capacity, renormalize,
                                     self.batch_prioritized, self.priority)
    routing = routing.replace(gates=scale(routing.gates, scaling_factor))
    aux = token_stats(routing, scores.probs, ~routing.kept, sequence_length)
    aux["lb_loss"] = losses.load_balancing_loss(scores.probs, routing.expert_index)
    aux["tokenwise_lb_loss"] = jnp.zeros((), jnp.float32)
    return routing, aux

