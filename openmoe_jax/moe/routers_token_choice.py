"""Token-choice router: each token picks its top-k experts (ST-MoE, OpenMoE v1)."""
import dataclasses
from typing import Any, Dict, Tuple

import gin
import jax
import jax.numpy as jnp

from openmoe_jax.moe import losses
from openmoe_jax.moe.gates import GateScores, scale
from openmoe_jax.moe.routers import (Routing, expert_capacity, token_stats,
                                     top_k_capacity_routing)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TokenChoiceRouter:
  """Top-k token choice with capacity (ST-MoE priority) or dropless.

  Reads `num_experts`, `top_k`, the capacity factors, `min_capacity`,
  `renormalize_gates` and `routed_scaling_factor` from the `MoeConfig` it is called
  with; its own fields:

  - `dropless`: no capacity; every choice is served (buffers hold a whole group).
  - `batch_prioritized`: within a choice rank, tokens with a higher top-1 score are
    served first (BPR, V-MoE). WARNING: a token's service then depends on later
    tokens of the group, which breaks causality in a decoder (train/inference
    mismatch); use it for encoders or ablations only.
  - `jitter_noise`: multiplicative uniform noise x * U(1 - eps, 1 + eps) on the
    router inputs in training (applied by the MoE layer; needs the "jitter" rng).
  - `capacity_per_choice`: False (default, ST-MoE / flaxformer / OpenMoE v1):
    capacity = cf x T / E, so top-2 at cf 1.25 has buffers for 62.5% of the
    choices; True (Megatron, ColossalAI, OpenMoE 2): cf x k x T / E, buffers for cf
    times the average load of every choice (what fine-grained top-k needs).

  Gin: `MoeConfig.router = @TokenChoiceRouter()`, `TokenChoiceRouter.dropless = True`.
  """

  dropless: bool = False
  batch_prioritized: bool = False
  jitter_noise: float = 0.0
  capacity_per_choice: bool = False

  def capacity(self, cfg: Any, tokens_per_group: int, train: bool) -> int:
    """Returns the per-expert buffer size for a group of `tokens_per_group` tokens."""
    if self.dropless:
      return tokens_per_group
    factor = cfg.capacity_factor(train) * (cfg.top_k if self.capacity_per_choice else 1)
    return expert_capacity(tokens_per_group, cfg.num_experts, factor, cfg.min_capacity)

  def __call__(self, gs: GateScores, cfg: Any, *, train: bool, sequence_length: int
               ) -> Tuple[Routing, Dict[str, jax.Array]]:
    """Returns (Routing with k = top_k, aux: stats and `lb_loss`)."""
    capacity = self.capacity(cfg, gs.scores.shape[1], train)
    routing = top_k_capacity_routing(gs.scores, cfg.top_k, capacity,
                                     cfg.renormalize_gates, self.batch_prioritized)
    routing = routing.replace(gates=scale(routing.gates, cfg.routed_scaling_factor))
    aux = token_stats(routing, gs.probs, ~routing.kept, sequence_length)
    aux["lb_loss"] = losses.load_balancing_loss(gs.probs, routing.expert_index)
    aux["tokenwise_lb_loss"] = jnp.zeros((), jnp.float32)
    return routing, aux

