"""The dispatcher contract: `ExpertWeights`, the pure expert MLPs, `Dispatcher`.

A dispatcher is called as `dispatcher(x_gsd, routing, weights) -> y_gsd`: it moves
the routed tokens of groups [g, s, d] to their experts, runs the experts on
`weights` (an `ExpertWeights`, made by the `Experts` module) and combines each
token's kept expert outputs weighted by their gates. It honours the drop decisions
in `routing` exactly; it never re-routes. Token choice (k = top-k options per token)
and expert choice (k = E options, option e = expert e) arrive in the same `Routing`
form, so one dispatcher serves both.
"""
from typing import Callable, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from openmoe_jax.layers.mlp import gated_hidden
from openmoe_jax.moe.routers import Routing

# matmul(lhs_nd, rhs_edf, group_sizes_e) -> [n, f]: kernels.grouped_matmul.
GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@flax.struct.dataclass
class ExpertWeights:
  """The weights of E gated MLPs (already in the compute dtype) and their kind."""

  wi_0: jax.Array  # [E, d, F0]: F0 = 2 F for "openmoe_swiglu", else F
  wi_1: jax.Array  # [E, d, F]
  wo: jax.Array  # [E, F, d]
  kind: str = flax.struct.field(pytree_node=False)  # layers/mlp.py MLP_KINDS

  @property
  def num_experts(self) -> int:
    """Returns E, the number of experts these weights hold."""
    return self.wi_1.shape[0]


def expert_mlp(weights: ExpertWeights, x_end: jax.Array) -> jax.Array:
  """Returns [E, n, d]: buffer e through gated MLP e."""
  h0 = jnp.einsum("end,edf->enf", x_end, weights.wi_0)
  h1 = jnp.einsum("end,edf->enf", x_end, weights.wi_1)
  return jnp.einsum("enf,efd->end", gated_hidden(weights.kind, h0, h1), weights.wo)


def expert_mlp_grouped(weights: ExpertWeights, x_nd: jax.Array,
                       group_sizes_e: jax.Array, matmul: GroupedMatmul) -> jax.Array:
  """Returns [n, d]: row block e (group_sizes_e[e] rows, in order) through expert e
  via `matmul`; zeros for the rows past the groups."""
  h0 = matmul(x_nd, weights.wi_0, group_sizes_e)
  h1 = matmul(x_nd, weights.wi_1, group_sizes_e)
  return matmul(gated_hidden(weights.kind, h0, h1), weights.wo, group_sizes_e)


class Dispatcher(Protocol):
  """What `MoeConfig.dispatcher` holds (frozen dataclasses, chosen in gin)."""

  def __call__(self, x_gsd: jax.Array, routing: Routing,
               weights: ExpertWeights) -> jax.Array:
    """Returns y_gsd: each token's kept expert outputs summed, weighted by gates."""
