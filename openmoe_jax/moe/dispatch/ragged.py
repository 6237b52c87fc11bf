"""Ragged (dropless-capable) dispatch: sort choices by expert, grouped matmul, unsort."""
import dataclasses
import functools
from typing import Optional

import gin
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from openmoe_jax.kernels import permute
from openmoe_jax.kernels.grouped_matmul import grouped_matmul
from openmoe_jax.moe.dispatch.base import ExpertWeights, expert_mlp_grouped
from openmoe_jax.moe.dispatch.primitives import (auto_tile, check_backend, combine_rows,
                                                 group_spec, max_kept_rows,
                                                 sort_by_expert)
from openmoe_jax.moe.routers import Routing


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
    check_backend("RaggedDispatcher", self.backend)

  def __call__(self, x_gsd: jax.Array, routing: Routing,
               weights: ExpertWeights) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if self.backend == "pallas" and not mesh.empty and mesh.size > 1:
      spec = group_spec(mesh, x_gsd.shape[0])
      # Expert weights whole on every device. check_vma off: pallas_call outputs
      # carry no varying-axes annotation.
      return jax.shard_map(self._dispatch, in_specs=(spec, spec, PartitionSpec()),
                           out_specs=spec, check_vma=False)(x_gsd, routing, weights)
    return self._dispatch(x_gsd, routing, weights)

  def _dispatch(self, x_gsd: jax.Array, routing: Routing,
                weights: ExpertWeights) -> jax.Array:
    """Returns y_gsd: the dispatch on this device's (or the only) arrays."""
    g, s, d = x_gsd.shape
    k = routing.expert_index.shape[-1]
    num_experts = weights.num_experts
    num_rows = max_kept_rows(routing, g * s, num_experts)
    order_m, group_sizes_e = sort_by_expert(routing, num_experts)
    order_r = order_m[:num_rows]
    x_nd = x_gsd.reshape(g * s, d)
    tile = self.tile or auto_tile(num_rows, num_experts)
    matmul = functools.partial(grouped_matmul, backend=self.backend, tile=tile,
                               interpret=self.interpret)
    group_sizes_e = group_sizes_e.astype(jnp.int32)
    if self.backend == "pallas":
      return self._permuted(x_nd, routing, order_r, group_sizes_e, weights,
                            matmul).reshape(g, s, d)
    y_rd = expert_mlp_grouped(weights, x_nd[order_r // k], group_sizes_e, matmul)
    return combine_rows(y_rd, order_r, routing, g * s).reshape(g, s, d)

  def _permuted(self, x_nd, routing, order_r, group_sizes_e, weights, matmul):
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
    y_rd = expert_mlp_grouped(weights, x_rd, group_sizes_e, matmul)
    gates_nk = routing.gates.reshape(num_tokens, k)
    return permute.combine(y_rd, row_nk, gates_nk, src_r, self.interpret)
