"""Gate functions: router logits -> gate scores, per-token renormalisation, scaling.

All math in float32. The gate kind is chosen once (`MoeConfig.gate`) and applied only
here, so routers see scores and never branch on the kind.

Router logits over all gated experts are named `logits_gsa` / `scores_gsa`: a = the
E routed experts followed by the S jointly gated shared experts (E + S columns).
"""
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp

GATE_KINDS = ("softmax", "sigmoid")


@flax.struct.dataclass
class GateScores:
  """What a router needs from the router logits of grouped tokens [g, s, .]."""

  logits: jax.Array  # [g, s, E] float32 routed-expert logits
  scores: jax.Array  # [g, s, E] gate value of each routed expert (before selection)
  probs: jax.Array  # [g, s, E] per-token distribution (sums to 1) for LB loss/entropy
  shared: jax.Array  # [g, s, S] gate scores of jointly gated shared experts (S >= 0)


def check_gate_kind(kind: str) -> None:
  """Raises ValueError naming `MoeConfig.gate` for an unknown kind; returns None."""
  if kind not in GATE_KINDS:
    raise ValueError(f"MoeConfig.gate={kind!r}; choose one of {GATE_KINDS}")


def gate_scores(logits_gsa: jax.Array, num_experts: int, kind: str) -> GateScores:
  """Returns `GateScores` from logits [g, s, E + S] (the last S columns: jointly gated
  shared experts).

  softmax: one softmax over all E + S logits (shared experts compete jointly with
  routed ones); sigmoid: an independent sigmoid per logit. `probs` is the routed
  scores renormalised to sum to 1 per token (the softmax itself when S = 0).
  """
  check_gate_kind(kind)
  logits_gsa = logits_gsa.astype(jnp.float32)
  if kind == "softmax":
    scores_gsa = jax.nn.softmax(logits_gsa, axis=-1)
  else:
    scores_gsa = jax.nn.sigmoid(logits_gsa)
  scores_gse = scores_gsa[..., :num_experts]
  exact = kind == "softmax" and logits_gsa.shape[-1] == num_experts
  probs_gse = scores_gse if exact else scores_gse / jnp.sum(
      scores_gse, axis=-1, keepdims=True)
  return GateScores(logits=logits_gsa[..., :num_experts], scores=scores_gse,
                    probs=probs_gse, shared=scores_gsa[..., num_experts:])


def renormalise(gates_gsk: jax.Array, selected_gsk: jax.Array) -> jax.Array:
  """Returns gates divided by the sum of the selected gates of their token.

  Unselected entries become 0; a token with nothing selected keeps all zeros.
  """
  gates_gsk = jnp.where(selected_gsk, gates_gsk, 0.0)
  total_gs1 = jnp.sum(gates_gsk, axis=-1, keepdims=True)
  return gates_gsk / jnp.where(total_gs1 > 0, total_gs1, 1.0)


def count_scaling(gates_gse: jax.Array, kept_gse: jax.Array,
                  factors: Optional[Sequence[float]]) -> jax.Array:
  """Returns gates times factors[number of experts that took the token] (expert choice).

  `factors` has E + 1 entries (index 0 .. E); None leaves the gates unchanged.
  """
  if factors is None:
    return gates_gse
  num_experts = gates_gse.shape[-1]
  if len(factors) != num_experts + 1:
    raise ValueError(f"count_scaling_factors needs num_experts + 1 = {num_experts + 1} "
                     f"entries, got {len(factors)}")
  count_gs = jnp.sum(kept_gse.astype(jnp.int32), axis=-1)
  factor_gs = jnp.asarray(factors, jnp.float32)[count_gs]
  return gates_gse * factor_gs[..., None]


def scale(gates: jax.Array, factor: float) -> jax.Array:
  """Returns gates times the constant routed scaling factor (exactly gates if 1)."""
  return gates if factor == 1.0 else gates * jnp.float32(factor)
