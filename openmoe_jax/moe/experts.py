"""Routed experts: E gated MLPs as a flax module, and the pure functions that apply
their weights (used directly by the shard_map expert-parallel dispatchers)."""
from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from openmoe_jax.layers.mlp import gated_hidden, mlp_params


def expert_mlp(kind: str, x_end: jax.Array, wi_0: jax.Array, wi_1: jax.Array,
               wo: jax.Array) -> jax.Array:
  """Returns [E, n, d]: buffer e through gated MLP e (weights [E, d, *], [E, *, d])."""
  h0 = jnp.einsum("end,edf->enf", x_end, wi_0)
  h1 = jnp.einsum("end,edf->enf", x_end, wi_1)
  return jnp.einsum("enf,efd->end", gated_hidden(kind, h0, h1), wo)


def expert_mlp_grouped(kind: str, x_nd: jax.Array, wi_0: jax.Array, wi_1: jax.Array,
                       wo: jax.Array, group_sizes_e: jax.Array,
                       matmul: Callable) -> jax.Array:
  """Returns [n, d]: row block e (group_sizes_e[e] rows, in order) through expert e
  via `matmul(lhs_nd, rhs_edf, group_sizes_e)`; zeros for rows past the groups."""
  h0 = matmul(x_nd, wi_0, group_sizes_e)
  h1 = matmul(x_nd, wi_1, group_sizes_e)
  return matmul(gated_hidden(kind, h0, h1), wo, group_sizes_e)


class Experts(nn.Module):
  """E gated MLPs applied to per-expert buffers [E, n, d] -> [E, n, d].

  `grouped` applies them to rows sorted in contiguous expert groups instead;
  `weights` returns the (cast) weights for code that applies them itself with
  `expert_mlp` / `expert_mlp_grouped` (the shard_map expert-parallel dispatchers).
  """

  num_experts: int
  kind: str
  d_ff: int
  dtype: Any = jnp.float32

  @nn.compact
  def weights(self, d_model: int) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (wi_0 [E, d, F0], wi_1 [E, d, F], wo [E, F, d]) in `dtype`."""
    ws = mlp_params(self, self.kind, d_model, self.d_ff, lead=(self.num_experts,),
                    lead_axes=("expert",), mlp_axis="expert_mlp")
    return tuple(w.astype(self.dtype) for w in ws)

  def __call__(self, x_end: jax.Array, group_sizes_e: Optional[jax.Array] = None,
               matmul: Optional[Callable] = None) -> jax.Array:
    wi_0, wi_1, wo = self.weights(x_end.shape[-1])
    if group_sizes_e is not None:  # x_end is x_nd here
      return expert_mlp_grouped(self.kind, x_end, wi_0, wi_1, wo, group_sizes_e, matmul)
    return expert_mlp(self.kind, x_end, wi_0, wi_1, wo)

  def grouped(self, x_nd: jax.Array, group_sizes_e: jax.Array,
              matmul: Callable) -> jax.Array:
    """Returns [n, d]: row block e (of group_sizes_e[e] rows, in order) through expert
    e, via `matmul(lhs_nd, rhs_edf, group_sizes_e)` (kernels.grouped_matmul); zeros
    for the rows past the groups."""
    return self(x_nd, group_sizes_e, matmul)
