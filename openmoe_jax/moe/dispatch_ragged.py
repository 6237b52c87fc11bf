"""Ragged (dropless-capable) dispatch: sort choices by expert, grouped matmul, unsort."""
import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import gin
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from openmoe_jax import partitioning
from openmoe_jax.kernels import permute
from openmoe_jax.kernels.grouped_matmul import BACKENDS, grouped_matmul
from openmoe_jax.moe.routers import Routing


def auto_tile(num_rows: int, num_experts: int) -> int:
  """Returns the padded backend's tile: the mean group size rounded down to a power of
  two, within [8, 128] (small tiles waste less padding, large ones loop less)."""
  mean = max(num_rows // num_experts, 1)
  return min(max(1 << (mean.bit_length() - 1), 8), 128)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RaggedDispatcher:
  """Sorts kept (token, choice) pairs by expert into contiguous groups, runs the
  experts as grouped matmuls (no capacity buffers, no padding beyond the backend's
  tile), and combines back with a scatter-add weighted by the gates.

  Serves exactly the kept choices of any `Routing` (capacity or dropless, token or
  expert choice); with `TokenChoiceRouter(dropless=True)` nothing is dropped. Rows:
  min(g * s * k, g * E * C) static, the kept ones first. Fields: `backend` of
  `grouped_matmul` ("padded": CPU-efficient; "ragged_dot": jax's op; "pallas": the
  TPU kernel) and its `tile` (None: `auto_tile`; the padded backend's only).
  With "pallas" the token gather and the weighted combine are the Pallas permute
  kernels too (kernels/permute.py; their XLA fallback off TPU). `interpret`: None
  picks by platform (kernels compiled on TPU; off TPU the grouped matmul in interpret
  mode and XLA permutes), True runs every Pallas kernel in interpret mode (tests).
  Mosaic kernels cannot be partitioned by GSPMD, so on a multi-device mesh the
  "pallas" path runs under shard_map: each device dispatches its own token groups
  (split like the batch) with all expert weights (gathered); for experts split over
  devices use the expert-parallel dispatchers.

  Gin: `MoeConfig.dispatcher = @RaggedDispatcher()`, `RaggedDispatcher.tile = 64`.
  """

  backend: str = "padded"
  tile: Optional[int] = None
  interpret: Optional[bool] = None

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"RaggedDispatcher.backend={self.backend!r}; choose one of "
                       f"{BACKENDS}")

  def __call__(self, x_gsd: jax.Array, routing: Routing, experts: Any,
               num_experts: int) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if self.backend == "pallas" and not mesh.empty and mesh.size > 1:
      return self._per_device(x_gsd, routing, experts, num_experts, mesh)
    return self._dispatch(x_gsd, routing, experts, num_experts)

  def _per_device(self, x_gsd, routing, experts, num_experts, mesh):
    """Returns _dispatch under shard_map: token groups split over their mesh axes
    (whole on every device when they do not split evenly, e.g. at init), expert
    weights whole."""
    names = mesh.axis_names
    group_axes = partitioning.mesh_axes(names, "expert_group")
    split = x_gsd.shape[0] % math.prod(mesh.shape[a] for a in group_axes) == 0
    spec = (partitioning.logical_spec(names, "expert_group") if split
            else PartitionSpec())
    weights = experts.weights(x_gsd.shape[-1])

    def local(x_gsd, routing, *weights):
      return self._dispatch(x_gsd, routing, _Weights(experts.kind, *weights),
                            num_experts)

    # check_vma off: pallas_call outputs carry no varying-axes annotation.
    return jax.shard_map(local, in_specs=(spec, spec) + (PartitionSpec(),) * 3,
                         out_specs=spec, check_vma=False)(x_gsd, routing, *weights)

  def _dispatch(self, x_gsd: jax.Array, routing: Routing, experts: Any,
                num_experts: int) -> jax.Array:
    """Returns y_gsd: the dispatch on this device's (or the only) arrays."""
    g, s, d = x_gsd.shape
    k = routing.expert_index.shape[-1]
    num_rows = min(g * s * k, g * num_experts * routing.capacity)
    key_m = jnp.where(routing.kept, routing.expert_index, num_experts).reshape(-1)
    order_r = jnp.argsort(key_m, stable=True)[:num_rows]
    group_sizes_e = jnp.bincount(key_m, length=num_experts + 1)[:num_experts]
    token_r = order_r // k
    x_nd = x_gsd.reshape(g * s, d)
    tile = self.tile or auto_tile(num_rows, num_experts)
    matmul = functools.partial(grouped_matmul, backend=self.backend, tile=tile,
                               interpret=self.interpret)
    group_sizes_e = group_sizes_e.astype(jnp.int32)
    if self.backend == "pallas":
      return self._permuted(x_nd, routing, order_r, group_sizes_e, experts,
                            matmul).reshape(g, s, d)
    y_rd = experts.grouped(x_nd[token_r], group_sizes_e, matmul)
    gate_r = routing.gates.reshape(-1)[order_r].astype(y_rd.dtype)
    y_nd = jnp.zeros((g * s, d), y_rd.dtype).at[token_r].add(y_rd * gate_r[:, None])
    return y_nd.reshape(g, s, d)

  def _permuted(self, x_nd, routing, order_r, group_sizes_e, experts, matmul):
    """Returns [g * s, d] through the permute kernels: gather the kept choices'
    token rows (empty rows past the groups), grouped matmul, weighted combine."""
    num_tokens, k = x_nd.shape[0], routing.expert_index.shape[-1]
    num_rows = order_r.shape[0]
    kept_r = jnp.arange(num_rows) < jnp.sum(group_sizes_e)  # kept choices sort first
    src_r = jnp.where(kept_r, order_r // k, -1).astype(jnp.int32)
    row_m = jnp.full((num_tokens * k,), -1, jnp.int32).at[order_r].set(
        jnp.where(kept_r, jnp.arange(num_rows, dtype=jnp.int32), -1))
    row_nk = row_m.reshape(num_tokens, k)
    x_rd = permute.permute(x_nd, src_r, row_nk, self.interpret)
    y_rd = experts.grouped(x_rd, group_sizes_e, matmul)
    gates_nk = routing.gates.reshape(num_tokens, k)
    return permute.combine(y_rd, row_nk, gates_nk, src_r, self.interpret)


class _Weights(NamedTuple):
  """Expert weights in the `experts.grouped` interface (inside shard_map)."""

  kind: str
  wi_0: jax.Array
  wi_1: jax.Array
  wo: jax.Array

  def grouped(self, x_nd, group_sizes_e, matmul):
    # Imported here: config.py imports this module (gin), experts.py imports config.
    from openmoe_jax.moe.experts import (  # pylint: disable=g-import-not-at-top
        expert_mlp_grouped)
    return expert_mlp_grouped(self.kind, x_nd, self.wi_0, self.wi_1, self.wo,
                              group_sizes_e, matmul)
