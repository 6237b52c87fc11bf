"""Expert-choice router: each expert takes its top-C tokens (Zhou et al.; OpenMoE 2)."""
import dataclasses
from typing import Dict, Optional, Sequence, Tuple

import gin
import jax
import jax.numpy as jnp

from openmoe_jax.moe import losses
from openmoe_jax.moe.gates import GateScores, count_scaling, renormalise, scale
from openmoe_jax.moe.routers import Routing, token_stats

LEVELS = ("batch", "sequence")


def expert_choice_routing(scores_ute: jax.Array, capacity: int, renormalize: bool = False,
                          count_factors: Optional[Sequence[float]] = None) -> Routing:
  """Returns expert-choice routing of units [u, t, E] (k = E options per token).

  Expert e takes the `capacity` tokens of each unit with the highest scores (ties: the
  earlier token), in decreasing score order: option e of a token is kept iff e took
  it, at `slot` = its rank. Gates are the scores of kept options, optionally
  renormalised over the experts that took the token, then multiplied by
  count_factors[number of experts that took it].
  """
  u, t, num_experts = scores_ute.shape
  scores_ute = scores_ute.astype(jnp.float32)
  _, token_uec = jax.lax.top_k(jnp.swapaxes(scores_ute, 1, 2), capacity)
  u_idx = jnp.arange(u)[:, None, None]
  e_idx = jnp.arange(num_experts)[None, :, None]
  c_uec = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), token_uec.shape)
  slot_ute = jnp.zeros((u, t, num_experts), jnp.int32).at[u_idx, token_uec, e_idx].set(
      c_uec)
  kept_ute = jnp.zeros((u, t, num_experts), bool).at[u_idx, token_uec, e_idx].set(True)
  gates_ute = jnp.where(kept_ute, scores_ute, 0.0)
  if renormalize:
    gates_ute = renormalise(gates_ute, kept_ute)
  gates_ute = count_scaling(gates_ute, kept_ute, count_factors)
  expert_ute = jnp.broadcast_to(jnp.arange(num_experts, dtype=jnp.int32), kept_ute.shape)
  return Routing(expert_index=expert_ute, slot=slot_ute, kept=kept_ute, gates=gates_ute,
                 capacity=capacity)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ExpertChoiceRouter:
  """Expert choice: every expert takes exactly C tokens of each unit of T tokens,
  C = min(max(round(cf * k * T / E), 1), T) (see `capacity`).

  T is the number of tokens of a group (`level="batch"`) or of one sequence
  (`level="sequence"`: an expert never picks across sequences; the MoE group must
  hold whole sequences). k = `top_k` (`MoeConfig.top_k`) is the average number of
  experts per token; cf = `capacity_factor` (`MoeConfig.capacity_factor(train)`;
  OpenMoE 2 uses 1.0); the MoE layer passes both (`moe.layer.router_arguments`).
  C is clamped to T because an expert cannot take a token twice: with cf * k >= E
  (e.g. an eval capacity factor of E / k) every expert takes every token. Tokens taken by no
  expert are dropped (`drop_fraction` = `no_expert_fraction` here).

  WARNING: which tokens an expert takes depends on later tokens of the unit, so expert
  choice is not causal; it suits bidirectional (diffusion) models.

  Fields: `count_scaling_factors` (E + 1 factors indexed by how many experts took a
  token, or None), `jitter_noise` (as in TokenChoiceRouter). Gin:
  `MoeConfig.router = @ExpertChoiceRouter()`, `ExpertChoiceRouter.level = "sequence"`.
  """

  level: str = "batch"
  count_scaling_factors: Optional[Tuple[float, ...]] = None
  jitter_noise: float = 0.0

  def __post_init__(self):
    if self.level not in LEVELS:
      raise ValueError(f"ExpertChoiceRouter.level={self.level!r}; choose one of {LEVELS}")
    if self.count_scaling_factors is not None:
      object.__setattr__(self, "count_scaling_factors",
                         tuple(float(f) for f in self.count_scaling_factors))

  def capacity(self, tokens_per_unit: int, *, num_experts: int, top_k: int,
               capacity_factor: float, min_capacity: int = 1) -> int:
    """Returns C, the tokens each expert takes from a unit of T = `tokens_per_unit`.

    C = round(cf * k * T / E) (Python's round: halves to even), at least 1 and at
    most T; cf = `capacity_factor`, k = `top_k`, E = `num_experts`. `min_capacity` is
    not used (C >= 1 always): it is accepted so both routers take the same arguments.
    """
    del min_capacity
    c = int(round(capacity_factor * top_k * tokens_per_unit / num_experts))
    return min(max(c, 1), tokens_per_unit)

  def __call__(self, scores: GateScores, *, top_k: int, capacity_factor: float,
               min_capacity: int, renormalize: bool, scaling_factor: float,
               sequence_length: int) -> Tuple[Routing, Dict[str, jax.Array]]:
    """Returns (Routing with k = E over groups, aux: stats, `tokenwise_lb_loss`) for
    the gate scores of groups [g, s, E] of sequences of `sequence_length` tokens."""
    g, s, num_experts = scores.scores.shape
    t = sequence_length if self.level == "sequence" else s
    if s % t:
      raise ValueError(f"sequence-level expert choice needs MoE groups of whole "
                       f"sequences: group of {s} tokens, sequences of {t}")
    m = s // t  # units per group
    capacity = self.capacity(t, num_experts=num_experts, top_k=top_k,
                             capacity_factor=capacity_factor, min_capacity=min_capacity)
    unit = expert_choice_routing(scores.scores.reshape(g * m, t, num_experts), capacity,
                                 renormalize, self.count_scaling_factors)
    offset_g1s1 = (jnp.arange(m, dtype=jnp.int32) * capacity)[None, :, None, None]
    slot_gse = (unit.slot.reshape(g, m, t, num_experts) + offset_g1s1).reshape(
        g, s, num_experts)
    regroup = lambda a: a.reshape(g, s, num_experts)
    routing = Routing(expert_index=regroup(unit.expert_index), slot=slot_gse,
                      kept=regroup(unit.kept),
                      gates=scale(regroup(unit.gates), scaling_factor),
                      capacity=m * capacity)
    no_expert_gs1 = ~jnp.any(routing.kept, axis=-1, keepdims=True)
    aux = token_stats(routing, scores.probs, no_expert_gs1, sequence_length)
    aux["lb_loss"] = jnp.zeros((), jnp.float32)
    aux["tokenwise_lb_loss"] = losses.tokenwise_load_balancing_loss(
        scores.logits.reshape(g * m, t, num_experts), unit.kept, top_k)
    return routing, aux
