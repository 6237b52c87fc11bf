"""Ragged (dropless-capable) dispatch: sort choices by expert, grouped matmul, unsort."""
import dataclasses
import functools
from typing import Any, Optional

import gin
import jax
import jax.numpy as jnp

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
  `grouped_matmul` ("padded": CPU-efficient; "ragged_dot": jax's op) and its `tile`
  (None: `auto_tile`).

  Gin: `MoeConfig.dispatcher = @RaggedDispatcher()`, `RaggedDispatcher.tile = 64`.
  """

  backend: str = "padded"
  tile: Optional[int] = None

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"RaggedDispatcher.backend={self.backend!r}; choose one of "
                       f"{BACKENDS}")

  def __call__(self, x_gsd: jax.Array, routing: Routing, experts: Any,
               num_experts: int) -> jax.Array:
    g, s, d = x_gsd.shape
    k = routing.expert_index.shape[-1]
    num_rows = min(g * s * k, g * num_experts * routing.capacity)
    key_m = jnp.where(routing.kept, routing.expert_index, num_experts).reshape(-1)
    order_r = jnp.argsort(key_m, stable=True)[:num_rows]
    group_sizes_e = jnp.bincount(key_m, length=num_experts + 1)[:num_experts]
    token_r = order_r // k
    x_nd = x_gsd.reshape(g * s, d)
    tile = self.tile or auto_tile(num_rows, num_experts)
    matmul = functools.partial(grouped_matmul, backend=self.backend, tile=tile)
    y_rd = experts.grouped(x_nd[token_r], group_sizes_e.astype(jnp.int32), matmul)
    gate_r = routing.gates.reshape(-1)[order_r].astype(y_rd.dtype)
    y_nd = jnp.zeros((g * s, d), y_rd.dtype).at[token_r].add(y_rd * gate_r[:, None])
    return y_nd.reshape(g, s, d)
