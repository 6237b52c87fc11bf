"""Dispatch engines: move routed tokens into per-expert buffers and back.

A dispatcher is called as `dispatcher(x_gsd, routing, expert_fn) -> y_gsd` where
`expert_fn` maps per-expert buffers [E, n, d] -> [E, n, d]. It honours the drop
decisions in `routing` exactly; it never re-routes. Token choice (k = top-k options
per token) and expert choice (k = E options, option e = expert e) arrive in the same
`Routing` form, so one dispatch mechanism serves both.
"""
from typing import Callable

import flax.struct
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


@flax.struct.dataclass
class EinsumDispatcher:
  """ST-MoE one-hot einsum dispatch: O(tokens x E x C) memory; best for small E."""

  def __call__(self, x_gsd: jax.Array, routing: Routing, expert_fn: ExpertFn,
               num_experts: int) -> jax.Array:
    g, _, d = x_gsd.shape
    dispatch_gsec = dispatch_mask(routing, num_experts, x_gsd.dtype)
    x_egcd = jnp.einsum("gsd,gsec->egcd", x_gsd, dispatch_gsec)
    y_end = expert_fn(x_egcd.reshape(num_experts, g * routing.capacity, d))
    y_egcd = y_end.reshape(num_experts, g, routing.capacity, d)
    combine_gsec = combine_weights(routing, num_experts, y_egcd.dtype)
    return jnp.einsum("egcd,gsec->gsd", y_egcd, combine_gsec)
