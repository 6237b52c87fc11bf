"""Dispatch engines: move routed tokens into per-expert buffers and back.

A dispatcher is called as `dispatcher(x_gsd, routing, experts, num_experts) -> y_gsd`
where `experts(x_end)` maps per-expert buffers [E, n, d] -> [E, n, d] (einsum, sort)
and `experts.grouped(x_nd, group_sizes_e, matmul)` maps rows in contiguous expert
groups [n, d] -> [n, d] (ragged, dispatch_ragged.py). It honours the drop decisions
in `routing` exactly; it never re-routes. Token choice (k = top-k options
per token) and expert choice (k = E options, option e = expert e) arrive in the same
`Routing` form, so one dispatch mechanism serves both.
"""
import dataclasses
from typing import Callable

import gin
import jax
import jax.numpy as jnp

from openmoe_jax.moe.routers import Routing

ExpertFn = Callable[[jax.Array], jax.Array]


def dispatch_mask(routing: Routing, num_experts: int, dtype=jnp.float32) -> jax.Array:
  """Returns the one-hot dispatch tensor [g, s, E, C] (1 where a kept choice lands)."""
  expert_gske = jax.nn.one_hot(routing.expert_index, num_experts, dtype=dtype)
  slot_gskc = jax.nn.one_hot(jnp.where(routing.kept, routing.slot, -1),
                             routing.capacity, dtype=dtype)
  return jnp.einsum("gske,gskc->gsec", expert_gske, slot_gskc)


def combine_weights(routing: Routing, num_experts: int, dtype=jnp.float32) -> jax.Array:
  """Returns combine weights [g, s, E, C]: the gate of each kept choice at its slot."""
  expert_gske = jax.nn.one_hot(routing.expert_index, num_experts, dtype=jnp.float32)
  slot_gskc = jax.nn.one_hot(jnp.where(routing.kept, routing.slot, -1),
                             routing.capacity, dtype=jnp.float32)
  return jnp.einsum("gske,gskc,gsk->gsec", expert_gske, slot_gskc,
                    routing.gates).astype(dtype)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class EinsumDispatcher:
  """ST-MoE one-hot einsum dispatch: O(tokens x E x C) memory; best for small E.

  Gin: `MoeConfig.dispatcher = @EinsumDispatcher()` (the default).
  """

  def __call__(self, x_gsd: jax.Array, routing: Routing, expert_fn: ExpertFn,
               num_experts: int) -> jax.Array:
    g, _, d = x_gsd.shape
    dispatch_gsec = dispatch_mask(routing, num_experts, x_gsd.dtype)
    x_egcd = jnp.einsum("gsd,gsec->egcd", x_gsd, dispatch_gsec)
    y_end = expert_fn(x_egcd.reshape(num_experts, g * routing.capacity, d))
    y_egcd = y_end.reshape(num_experts, g, routing.capacity, d)
    combine_gsec = combine_weights(routing, num_experts, y_egcd.dtype)
    return jnp.einsum("egcd,gsec->gsd", y_egcd, combine_gsec)


def buffer_rows(routing: Routing, num_experts: int) -> jax.Array:
  """Returns [g, s, k] int32: the row of each kept choice in the flat expert buffer
  [E * g * C] (layout [E, g, C], as the einsum path), E * g * C where not kept."""
  g = routing.expert_index.shape[0]
  c = routing.capacity
  group_g11 = jnp.arange(g, dtype=jnp.int32)[:, None, None]
  row_gsk = routing.expert_index * (g * c) + group_g11 * c + routing.slot
  return jnp.where(routing.kept, row_gsk, num_experts * g * c).astype(jnp.int32)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SortDispatcher:
  """Index dispatch into [E, g * C] buffers: memory O(tokens x k x d), no E x C one-hots.

  The slots in `Routing` already order each expert's kept choices by ST-MoE
  priority, so the (expert, slot) sort is an inverse permutation: scatter each kept
  choice's token id to its buffer row, gather token rows into the buffers, run the
  experts, gather each choice's output row back and sum them weighted by the gates.
  Same kept choices and buffer layout as EinsumDispatcher.

  Gin: `MoeConfig.dispatcher = @SortDispatcher()`.
  """

  def __call__(self, x_gsd: jax.Array, routing: Routing, expert_fn: ExpertFn,
               num_experts: int) -> jax.Array:
    g, s, d = x_gsd.shape
    k = routing.expert_index.shape[-1]
    rows = num_experts * g * routing.capacity
    row_gsk = buffer_rows(routing, num_experts)
    token_gsk = jnp.broadcast_to(
        jnp.arange(g * s, dtype=jnp.int32).reshape(g, s, 1), (g, s, k))
    # Unkept choices all land on the spare last row, which is cut off.
    source_r = jnp.full((rows + 1,), g * s, jnp.int32).at[row_gsk.reshape(-1)].set(
        token_gsk.reshape(-1))[:rows]
    x_nd = jnp.concatenate([x_gsd.reshape(g * s, d), jnp.zeros((1, d), x_gsd.dtype)])
    y_end = expert_fn(x_nd[source_r].reshape(num_experts, g * routing.capacity, d))
    y_rd = jnp.concatenate([y_end.reshape(rows, d), jnp.zeros((1, d), y_end.dtype)])
    return jnp.einsum("gskd,gsk->gsd", y_rd[row_gsk],
                      routing.gates.astype(y_rd.dtype))
