"""Dispatch engines: move routed tokens into per-expert buffers and back.

A dispatcher is called as `dispatcher(x_gsd, routing, experts, num_experts) -> y_gsd`
where `experts(x_end)` maps per-expert buffers [E, n, d] -> [E, n, d] (einsum, sort)
and `experts.grouped(x_nd, group_sizes_e, matmul)` maps rows in contiguous expert
groups [n, d] -> [n, d] (ragged, dispatch_ragged.py). It honours the drop decisions
in `routing` exactly; it never re-routes. Token choice (k = top-k options
per token) and expert choice (k = E options, option e = expert e) arrive in the same
`Routing` form, so one dispatch mechanism serves both.

Under a mesh (GSPMD expert parallelism) the buffer engines here constrain their
buffers to the expert layout, so XLA moves tokens with all-to-alls over 'expert'.
The shard_map expert-parallel dispatchers are in expert_parallel.py (fixed
capacity, `lax.all_to_all`) and expert_parallel_ragged.py (dropless,
`lax.ragged_all_to_all`).
"""
import dataclasses
from typing import Callable

import flax.linen as nn
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


BUFFER_AXES = ("act_expert", "expert_buffer_group", "capacity", "act_embed")
GROUP_AXES = ("expert_group", "length", "act_embed")


def dispatch_through_buffers(engine, x_gsd: jax.Array, routing: Routing,
                             expert_fn: ExpertFn, num_experts: int) -> jax.Array:
  """Returns y_gsd: `engine.to_buffers`, experts, `engine.from_buffers`.

  The buffers [E, g, C, d] are constrained to the expert layout (experts over the
  'expert' mesh axis, groups over the other batch axes) and the result back to the
  token-group layout, so that under GSPMD the moves in and out of the experts are
  all-to-alls over 'expert' rather than all-gathers (no-ops outside a mesh).
  """
  x_egcd = nn.with_logical_constraint(
      engine.to_buffers(x_gsd, routing, num_experts), BUFFER_AXES)
  e, g, c, d = x_egcd.shape
  y_egcd = nn.with_logical_constraint(
      expert_fn(x_egcd.reshape(e, g * c, d)).reshape(e, g, c, d), BUFFER_AXES)
  return nn.with_logical_constraint(
      engine.from_buffers(y_egcd, routing, num_experts), GROUP_AXES)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class EinsumDispatcher:
  """ST-MoE one-hot einsum dispatch: O(tokens x E x C) memory; best for small E.

  Buffers [E, g, C, d]; `to_buffers` / `from_buffers` are the local halves reused by
  the shard_map expert-parallel dispatcher (expert_parallel.py).

  Gin: `MoeConfig.dispatcher = @EinsumDispatcher()`.
  """

  def __call__(self, x_gsd: jax.Array, routing: Routing, expert_fn: ExpertFn,
               num_experts: int) -> jax.Array:
    return dispatch_through_buffers(self, x_gsd, routing, expert_fn, num_experts)

  def to_buffers(self, x_gsd: jax.Array, routing: Routing,
                 num_experts: int) -> jax.Array:
    """Returns the expert buffers [E, g, C, d] (zeros in unused slots)."""
    return jnp.einsum("gsd,gsec->egcd", x_gsd,
                      dispatch_mask(routing, num_experts, x_gsd.dtype))

  def from_buffers(self, y_egcd: jax.Array, routing: Routing,
                   num_experts: int) -> jax.Array:
    """Returns [g, s, d]: each token's kept expert outputs summed, weighted by gates."""
    return jnp.einsum("egcd,gsec->gsd", y_egcd,
                      combine_weights(routing, num_experts, y_egcd.dtype))


def group_rows(routing: Routing, num_experts: int) -> jax.Array:
  """Returns [g, s, k] int32: the row of each kept choice in its group's block of the
  buffers, [E * C] (expert-major), and E * C where not kept."""
  c = routing.capacity
  row_gsk = routing.expert_index * c + routing.slot
  return jnp.where(routing.kept, row_gsk, num_experts * c).astype(jnp.int32)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SortDispatcher:
  """Index dispatch into [E, g, C, d] buffers: memory O(tokens x k x d), no E x C
  one-hots.

  The slots in `Routing` already order each expert's kept choices by ST-MoE
  priority, so the (expert, slot) sort is an inverse permutation: within each group,
  scatter each kept choice's position to its buffer row, gather token rows into the
  buffers, run the experts, gather each choice's output row back and sum them
  weighted by the gates. Everything is per group (vmapped), so groups split over
  devices stay local. Same kept choices and buffer layout as EinsumDispatcher.

  Gin: `MoeConfig.dispatcher = @SortDispatcher()`.
  """

  def __call__(self, x_gsd: jax.Array, routing: Routing, expert_fn: ExpertFn,
               num_experts: int) -> jax.Array:
    return dispatch_through_buffers(self, x_gsd, routing, expert_fn, num_experts)

  def to_buffers(self, x_gsd: jax.Array, routing: Routing,
                 num_experts: int) -> jax.Array:
    """Returns the expert buffers [E, g, C, d] (zeros in unused slots)."""
    g, s, d = x_gsd.shape
    rows = num_experts * routing.capacity
    row_gsk = group_rows(routing, num_experts)
    position_sk = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[:, None],
                                   row_gsk.shape[1:])

    def gather(x_sd, row_sk):
      # Unkept choices all land on the spare last row, which is cut off; empty
      # slots read the zero row appended at position s.
      source_r = jnp.full((rows + 1,), s, jnp.int32).at[row_sk.reshape(-1)].set(
          position_sk.reshape(-1))[:rows]
      return jnp.concatenate([x_sd, jnp.zeros((1, d), x_sd.dtype)])[source_r]

    x_grd = jax.vmap(gather)(x_gsd, row_gsk)
    return jnp.swapaxes(x_grd.reshape(g, num_experts, routing.capacity, d), 0, 1)

  def from_buffers(self, y_egcd: jax.Array, routing: Routing,
                   num_experts: int) -> jax.Array:
    """Returns [g, s, d]: each token's kept expert outputs summed, weighted by gates."""
    e, g, c, d = y_egcd.shape
    y_grd = jnp.swapaxes(y_egcd, 0, 1).reshape(g, e * c, d)
    y_grd = jnp.concatenate([y_grd, jnp.zeros((g, 1, d), y_grd.dtype)], axis=1)
    y_gskd = jax.vmap(lambda y_rd, row_sk: y_rd[row_sk])(
        y_grd, group_rows(routing, num_experts))
    return jnp.einsum("gskd,gsk->gsd", y_gskd, routing.gates.astype(y_gskd.dtype))
