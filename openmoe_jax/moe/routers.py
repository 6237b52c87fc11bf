"""Routing core: the `Routing` record, capacity, token-choice priority, statistics.

A router (routers_token_choice.py, routers_expert_choice.py; chosen in gin through
`MoeConfig.router`) turns `GateScores` of grouped tokens [g, s] into a `Routing`:
for each token and each of its k options, the expert, the slot in that expert's
buffer, whether the option is kept and its combine weight. Token choice has k = top-k
choices; expert choice has k = E options (option e is expert e, kept where expert e
took the token). Dispatchers (moe/dispatch/) consume any `Routing` the same way
and never re-decide drops. `RouterLogits` is the learned projection that gives the
router logits the gate functions (gates.py) turn into scores.
"""
from typing import Dict

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from openmoe_jax.layers.matmul import rows_matmul


@flax.struct.dataclass
class Routing:
  """Routing decisions for grouped tokens; all arrays are [g, s, k]."""

  expert_index: jax.Array  # int32 expert of the option
  slot: jax.Array  # int32 position in the expert's buffer (valid where kept)
  kept: jax.Array  # bool: served within capacity
  gates: jax.Array  # float32 combine weight, 0 where not kept
  capacity: int = flax.struct.field(pytree_node=False)  # buffer slots per expert


def expert_capacity(tokens_per_group: int, num_experts: int, capacity_factor: float,
                    min_capacity: int) -> int:
  """Returns max(round(capacity_factor * tokens_per_group / num_experts), min_capacity)."""
  return max(int(round(capacity_factor * tokens_per_group / num_experts)), min_capacity)


PRIORITIES = ("choice_major", "position_major")


def top_k_capacity_routing(probs_gse: jax.Array, top_k: int, capacity: int,
                           renormalize: bool = False,
                           batch_prioritized: bool = False,
                           priority: str = "choice_major") -> Routing:
  """Returns ST-MoE token-choice routing with capacity.

  `priority` is the order in which choices claim buffer slots:

  - "choice_major" (flaxformer, OpenMoE): every token's 1st choice is served before
    any token's 2nd choice; within one choice rank tokens are served in sequence
    order (or, with `batch_prioritized`, by decreasing top-1 score, ties by
    position). With top_k >= 2 a later token's 1st choice can take the slot an
    earlier token's 2nd choice needed: not causal.
  - "position_major": tokens in sequence order, each token's choices in rank order,
    so a token's service depends only on the tokens before it in its group: causal.
    `batch_prioritized` contradicts it and is refused.

  A choice whose expert is already full is dropped (its gate becomes 0). Gates are
  the scores of the chosen experts, optionally renormalised over the top-k (before
  dropping). `capacity >= s` serves every choice (dropless) under either priority.
  """
  _check_priority(priority, batch_prioritized)
  g, s, num_experts = probs_gse.shape
  gates_gsk, expert_gsk = jax.lax.top_k(probs_gse.astype(jnp.float32), top_k)
  order_gs = None
  if batch_prioritized:
    order_gs = jnp.argsort(-gates_gsk[..., 0], axis=1, stable=True)
    expert_gsk = jnp.take_along_axis(expert_gsk, order_gs[..., None], axis=1)
  if renormalize:
    gates_gsk = gates_gsk / jnp.sum(gates_gsk, axis=-1, keepdims=True)
  slot_gsk = _slots(expert_gsk, num_experts, priority == "choice_major")
  if batch_prioritized:  # back to sequence order
    inverse_gs = jnp.argsort(order_gs, axis=1)
    expert_gsk = jnp.take_along_axis(expert_gsk, inverse_gs[..., None], axis=1)
    slot_gsk = jnp.take_along_axis(slot_gsk, inverse_gs[..., None], axis=1)
  kept_gsk = slot_gsk < capacity
  return Routing(expert_index=expert_gsk.astype(jnp.int32), slot=slot_gsk,
                 kept=kept_gsk, gates=jnp.where(kept_gsk, gates_gsk, 0.0),
                 capacity=capacity)


def _check_priority(priority: str, batch_prioritized: bool) -> None:
  """Raises ValueError for an unknown priority or one that contradicts BPR."""
  if priority not in PRIORITIES:
    raise ValueError(f"token-choice priority={priority!r}; choose one of {PRIORITIES}")
  if batch_prioritized and priority == "position_major":
    raise ValueError("batch_prioritized=True serves tokens by score, not by position; "
                     "it cannot be combined with priority='position_major' (use "
                     "priority='choice_major' for BPR, or drop batch_prioritized)")


# Above this many one-hot entries (choices x E per group) slots come from a sort.
SLOTS_ONE_HOT_MAX = 1 << 20


def _slots(expert_gsk: jax.Array, num_experts: int, rank_first: bool) -> jax.Array:
  """Returns each choice's int32 slot [g, s, k] in its expert's buffer: the number
  of choices for that expert served before it, choice rank first or token first.

  Small groups count with a cumulative sum of one-hots (O(s k E)); large ones with
  a stable sort by expert (O(s k log(s k))): a choice's slot is its place in the
  sorted order minus its expert's first place. Both give the same integers."""
  g, s, k = expert_gsk.shape
  if rank_first:
    expert_gsk = jnp.swapaxes(expert_gsk, 1, 2)
  expert_gn = expert_gsk.reshape(g, s * k)
  if s * k * num_experts <= SLOTS_ONE_HOT_MAX:
    onehot_gne = jax.nn.one_hot(expert_gn, num_experts, dtype=jnp.int32)
    before_gne = jnp.cumsum(onehot_gne, axis=1) - 1
    slot_gn = jnp.sum(before_gne * onehot_gne, axis=-1)
  else:
    slot_gn = jax.vmap(lambda e_n: _sorted_slots(e_n, num_experts))(expert_gn)
  if rank_first:
    return jnp.swapaxes(slot_gn.reshape(g, k, s), 1, 2).astype(jnp.int32)
  return slot_gn.reshape(g, s, k).astype(jnp.int32)


def _sorted_slots(expert_n: jax.Array, num_experts: int) -> jax.Array:
  """Returns [n]: how many earlier entries of `expert_n` name the same expert."""
  n = expert_n.shape[0]
  order_n = jnp.argsort(expert_n, stable=True)
  place_n = jnp.zeros((n,), jnp.int32).at[order_n].set(
      jnp.arange(n, dtype=jnp.int32), unique_indices=True)
  count_e = jnp.bincount(expert_n, length=num_experts)
  return place_n - (jnp.cumsum(count_e) - count_e)[expert_n]


def routing_stats(routing: Routing, probs_gse: jax.Array) -> Dict[str, jax.Array]:
  """Returns drop_fraction, expert_load [E] (share of top-k choices, sums to 1) and
  router_entropy (mean over tokens, nats)."""
  num_experts = probs_gse.shape[-1]
  load_e = jnp.mean(jax.nn.one_hot(routing.expert_index, num_experts,
                                   dtype=jnp.float32), axis=(0, 1, 2))
  probs = probs_gse.astype(jnp.float32)
  entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-9)), axis=-1)
  return {
      "drop_fraction": 1.0 - jnp.mean(routing.kept.astype(jnp.float32)),
      "expert_load": load_e,
      "router_entropy": jnp.mean(entropy),
  }


def token_stats(routing: Routing, probs_gse: jax.Array, dropped_gsj: jax.Array,
                sequence_length: int) -> Dict[str, jax.Array]:
  """Returns `routing_stats` with drop_fraction taken from `dropped_gsj` (what the
  router counts as dropped), plus drop_fraction_first_quarter and
  drop_fraction_last_quarter (first / last quarter of the positions of each
  sequence: compare them to see drops pile up late, e.g. between token-choice
  priorities), no_expert_fraction (tokens served by no expert) and
  experts_per_token_{mean,min,max}."""
  stats = routing_stats(routing, probs_gse)
  dropped = dropped_gsj.astype(jnp.float32)
  t = sequence_length
  quarter = max(t // 4, 1)
  dropped_btj = dropped.reshape(-1, t, dropped.shape[-1])
  stats["drop_fraction"] = jnp.mean(dropped)
  stats["drop_fraction_first_quarter"] = jnp.mean(dropped_btj[:, :quarter])
  stats["drop_fraction_last_quarter"] = jnp.mean(dropped_btj[:, t - quarter:])
  count_gs = jnp.sum(routing.kept.astype(jnp.float32), axis=-1)
  stats["no_expert_fraction"] = jnp.mean((count_gs == 0).astype(jnp.float32))
  stats["experts_per_token_mean"] = jnp.mean(count_gs)
  stats["experts_per_token_min"] = jnp.min(count_gs)
  stats["experts_per_token_max"] = jnp.max(count_gs)
  return stats


class RouterLogits(nn.Module):
  """The router's linear projection, without bias, in float32: [g, s, d] -> logits
  [g, s, E + S] (`logits_gsa`: a = the E routed then the S gated shared experts).

  The last `num_shared` columns are the logits of jointly gated shared experts; they
  come from their own parameter `w_shared`, not from the routed experts' `w`. The
  routing policy that reads them is a separate object (`TokenChoiceRouter`,
  `ExpertChoiceRouter`).
  """

  num_experts: int
  init_std: float  # MoeConfig.router_init_std
  num_shared: int

  @nn.compact
  def __call__(self, x_gsd: jax.Array) -> jax.Array:
    def weight(name, width):
      return self.param(
          name, nn.with_logical_partitioning(nn.initializers.normal(self.init_std),
                                             ("embed", "unmodeled")),
          (x_gsd.shape[-1], width), jnp.float32)
    x_gsd = x_gsd.astype(jnp.float32)
    logits_gse = rows_matmul(x_gsd, weight("w", self.num_experts))
    if not self.num_shared:
      return logits_gse
    shared_gsS = rows_matmul(x_gsd, weight("w_shared", self.num_shared))
    return jnp.concatenate([logits_gse, shared_gsS], axis=-1)
