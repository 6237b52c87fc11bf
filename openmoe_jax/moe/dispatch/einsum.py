"""ST-MoE one-hot einsum dispatch (flaxformer's): best for small E x C."""
import dataclasses

import gin
import jax
import jax.numpy as jnp

from openmoe_jax.moe.dispatch.buffers import BufferDispatcher
from openmoe_jax.moe.routers import Routing


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
class EinsumDispatcher(BufferDispatcher):
  """One-hot einsum dispatch into [E, g, C, d] buffers: O(tokens x E x C) memory.

  Gin: `MoeConfig.dispatcher = @EinsumDispatcher()`.
  """

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
