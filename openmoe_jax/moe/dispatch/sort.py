"""Index dispatch into capacity buffers: the einsum dispatcher's result without its
E x C one-hots."""
import dataclasses

import gin
import jax
import jax.numpy as jnp

from openmoe_jax.moe.dispatch.buffers import BufferDispatcher
from openmoe_jax.moe.routers import Routing


def group_rows(routing: Routing, num_experts: int) -> jax.Array:
  """Returns [g, s, k] int32: the row of each kept choice in its group's block of the
  buffers, [E * C] (expert-major), and E * C where not kept."""
  c = routing.capacity
  row_gsk = routing.expert_index * c + routing.slot
  return jnp.where(routing.kept, row_gsk, num_experts * c).astype(jnp.int32)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SortDispatcher(BufferDispatcher):
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
