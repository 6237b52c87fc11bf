"""Dropless expert parallelism: shard_map + `jax.lax.ragged_all_to_all`.

Each device sorts its kept (token, choice) rows by expert, the devices exchange
exact per-expert counts, and one ragged all-to-all sends every row to the device
that owns its expert (no capacity padding on the wire). There the rows are regrouped
by local expert, run as grouped matmuls, and a second ragged all-to-all sends them
back to the slots they came from, to be combined with the gates.

`jax.lax.ragged_all_to_all` runs on TPU v4+ and GPU only (not on CPU or TPU v3).
`exchange="dense"` swaps it for `dense_ragged_all_to_all`, the same exchange from a
padded `jax.lax.all_to_all`, so that everything else is tested on CPU.
"""
import dataclasses
import functools
from typing import Optional

import gin
import jax
import jax.numpy as jnp

from openmoe_jax import partitioning
from openmoe_jax.kernels.grouped_matmul import grouped_matmul
from openmoe_jax.moe.dispatch.base import ExpertWeights, expert_mlp_grouped
from openmoe_jax.moe.dispatch.primitives import (ExpertMesh, auto_tile, check_backend,
                                                 combine_rows, current_expert_mesh,
                                                 expert_parallel_specs, join_wi_0,
                                                 sort_by_expert, split_wi_0)
from openmoe_jax.moe.dispatch.ragged import RaggedDispatcher
from openmoe_jax.moe.routers import Routing

EXCHANGES = ("ragged", "dense")


def exclusive_cumsum(x: jax.Array) -> jax.Array:
  """Returns [0, x0, x0 + x1, ...] (same length as x)."""
  return jnp.cumsum(x) - x


def dense_ragged_all_to_all(operand, output, input_offsets, send_sizes,
                            output_offsets, recv_sizes, *, axis_name):
  """Returns what `jax.lax.ragged_all_to_all` returns, built from a dense all-to-all
  of [P, n, ...] chunks (P devices; n = the operand's or the output's rows, whichever
  is fewer, a bound on any one slice): runs everywhere, up to P times the traffic.
  For tests and platforms without the ragged collective."""
  n = min(operand.shape[0], output.shape[0])
  padded = jnp.concatenate([operand, jnp.zeros((n,) + operand.shape[1:],
                                               operand.dtype)])
  row_n = jnp.arange(n)
  chunks = jax.vmap(lambda off: jax.lax.dynamic_slice_in_dim(padded, off, n))(
      input_offsets)
  mask = (row_n[None, :] < send_sizes[:, None]).reshape(
      chunks.shape[:2] + (1,) * (operand.ndim - 1))
  received = jax.lax.all_to_all(jnp.where(mask, chunks, 0), axis_name, 0, 0,
                                tiled=True)
  # Where each source's rows go in my output (it chose them: output_offsets).
  start_p = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  dest_pn = jnp.where(row_n[None, :] < recv_sizes[:, None],
                      start_p[:, None] + row_n[None, :], output.shape[0])
  return output.at[dest_pn.reshape(-1)].set(
      received.reshape((-1,) + operand.shape[1:]), mode="drop")


def local_expert_of_rows(counts_pe: jax.Array, num_rows: int) -> jax.Array:
  """Returns [num_rows]: the local expert of each received row, whose layout is
  source-major then expert (counts_pe [P, E_local] rows each), E_local past them."""
  e_local = counts_pe.shape[1]
  ends = jnp.cumsum(counts_pe.reshape(-1))
  segment_r = jnp.searchsorted(ends, jnp.arange(num_rows), side="right")
  return jnp.where(segment_r < ends.shape[0], segment_r % e_local, e_local)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RaggedAllToAllDispatcher:
  """Dropless expert parallel dispatch: shard_map + ragged all-to-all over experts.

  Serves exactly the kept choices of any `Routing` (with
  `TokenChoiceRouter.dropless = True`, all of them), like `RaggedDispatcher`, which
  it falls back to without a mesh or when the expert axis has size 1. Each device
  receives into a buffer of P x (its rows) rows, the worst case (every row sent to
  one device), so nothing is ever dropped. Fields: `backend` and `tile` of
  `grouped_matmul` ("ragged_dot": jax's op, dense masking on CPU; "padded": the CPU
  path; "pallas": the TPU kernels; the last two run with shard_map's check_vma off,
  as their loop carries and kernel outputs carry no varying-axes types),
  `exchange` ("ragged": `jax.lax.ragged_all_to_all`; "dense": a padded
  `jax.lax.all_to_all` doing the same, for CPU and TPU v3).

  Gin: `MoeConfig.dispatcher = @RaggedAllToAllDispatcher()`.
  """

  backend: str = "ragged_dot"
  tile: Optional[int] = None
  exchange: str = "ragged"

  def __post_init__(self):
    check_backend("RaggedAllToAllDispatcher", self.backend)
    if self.exchange not in EXCHANGES:
      raise ValueError(f"RaggedAllToAllDispatcher.exchange={self.exchange!r}; choose "
                       f"one of {EXCHANGES}")

  def __call__(self, x_gsd: jax.Array, routing: Routing,
               weights: ExpertWeights) -> jax.Array:
    num_experts = weights.num_experts
    expert_mesh = current_expert_mesh(x_gsd.shape[0], num_experts)
    if expert_mesh is None:
      return RaggedDispatcher(backend=self.backend, tile=self.tile)(
          x_gsd, routing, weights)
    names = jax.sharding.get_abstract_mesh().axis_names
    group_spec = partitioning.logical_spec(names, "expert_group")
    local = functools.partial(self._local, expert_mesh=expert_mesh,
                              num_experts=num_experts)
    weights = split_wi_0(weights)
    return jax.shard_map(local, in_specs=(group_spec, group_spec,
                                          expert_parallel_specs(weights)),
                         out_specs=group_spec, check_vma=self.backend == "ragged_dot"
                         )(x_gsd, routing, weights)

  def _local(self, x_gsd: jax.Array, routing: Routing, weights: ExpertWeights, *,
             expert_mesh: ExpertMesh, num_experts: int) -> jax.Array:
    """The per-device body: returns this device's [g, s, d] outputs."""
    g, s, d = x_gsd.shape
    k = routing.expert_index.shape[-1]
    axis = expert_mesh.axis(expert_mesh.expert_axes)
    exchange = (jax.lax.ragged_all_to_all if self.exchange == "ragged"
                else dense_ragged_all_to_all)
    # My kept rows sorted by expert: the ones for device p are contiguous.
    order_m, counts_e = sort_by_expert(routing, num_experts)
    token_m = order_m // k
    counts_pe = counts_e.reshape(expert_mesh.expert_size, -1).astype(jnp.int32)
    send_p = jnp.sum(counts_pe, axis=1)
    send_offsets_p = exclusive_cumsum(send_p)
    # What each source sends me per local expert, and where my rows land on each
    # destination (after the rows of the sources before me).
    recv_counts_pe = jax.lax.all_to_all(counts_pe, axis, 0, 0, tiled=True)
    recv_p = jnp.sum(recv_counts_pe, axis=1)
    sent_pp = jax.lax.all_gather(send_p, axis)  # [source, destination]
    land_offsets_p = (jnp.cumsum(sent_pp, axis=0) - sent_pp)[
        jax.lax.axis_index(axis)]
    num_recv = expert_mesh.expert_size * g * s * k
    x_rd = exchange(x_gsd.reshape(g * s, d)[token_m], jnp.zeros((num_recv, d),
                    x_gsd.dtype), send_offsets_p, send_p, land_offsets_p, recv_p,
                    axis_name=axis)
    # Regroup the received rows by local expert and run the experts.
    expert_r = local_expert_of_rows(recv_counts_pe, num_recv)
    order_r = jnp.argsort(expert_r, stable=True)
    group_sizes_e = jnp.sum(recv_counts_pe, axis=0)
    matmul = functools.partial(grouped_matmul, backend=self.backend, tile=self.tile
                               or auto_tile(num_recv, group_sizes_e.shape[0]))
    y_sorted = expert_mlp_grouped(join_wi_0(weights), x_rd[order_r], group_sizes_e,
                                  matmul)
    y_rd = jnp.zeros_like(y_sorted).at[order_r].set(y_sorted, unique_indices=True)
    # Send each row back to where it came from in its source's sorted rows.
    back_offsets_p = jax.lax.all_to_all(send_offsets_p, axis, 0, 0, tiled=True)
    recv_offsets_p = exclusive_cumsum(recv_p)
    y_md = exchange(y_rd, jnp.zeros((g * s * k, d), y_rd.dtype), recv_offsets_p,
                    recv_p, back_offsets_p, send_p, axis_name=axis)
    y_nd = combine_rows(y_md, order_m, routing, g * s)
    if expert_mesh.hidden_axes:  # split hidden units: partial sums
      y_nd = jax.lax.psum(y_nd, expert_mesh.axis(expert_mesh.hidden_axes))
    return y_nd.reshape(g, s, d)
