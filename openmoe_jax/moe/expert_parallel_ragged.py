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
from typing import Any, Optional

import gin
import jax
import jax.numpy as jnp

from openmoe_jax import partitioning
from openmoe_jax.kernels.grouped_matmul import BACKENDS, grouped_matmul
from openmoe_jax.moe.dispatch_ragged import RaggedDispatcher, auto_tile
from openmoe_jax.moe.expert_parallel import (current_expert_mesh, join_wi_0,
                                             split_weights, weight_specs)
from openmoe_jax.moe.experts import expert_mlp_grouped
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
    if self.backend not in BACKENDS:
      raise ValueError(f"RaggedAllToAllDispatcher.backend={self.backend!r}; choose "
                       f"one of {BACKENDS}")
    if self.exchange not in EXCHANGES:
      raise ValueError(f"RaggedAllToAllDispatcher.exchange={self.exchange!r}; choose "
                       f"one of {EXCHANGES}")

  def __call__(self, x_gsd: jax.Array, routing: Routing, experts: Any,
               num_experts: int) -> jax.Array:
    em = current_expert_mesh(x_gsd.shape[0], num_experts)
    if em is None:
      return RaggedDispatcher(backend=self.backend, tile=self.tile)(
          x_gsd, routing, experts, num_experts)
    weights = split_weights(experts, x_gsd.shape[-1])
    names = jax.sharding.get_abstract_mesh().axis_names
    group_spec = partitioning.logical_spec(names, "expert_group")
    local = functools.partial(self._local, em=em, kind=experts.kind,
                              num_experts=num_experts)
    return jax.shard_map(local, in_specs=(group_spec, group_spec) + weight_specs(names),
                         out_specs=group_spec, check_vma=self.backend == "ragged_dot"
                         )(x_gsd, routing, *weights)

  def _local(self, x_gsd, routing, wi_0, wi_1, wo, *, em, kind, num_experts):
    """The per-device body: returns this device's [g, s, d] outputs."""
    g, s, d = x_gsd.shape
    k = routing.expert_index.shape[-1]
    axis = em.axis(em.expert_axes)
    exchange = (jax.lax.ragged_all_to_all if self.exchange == "ragged"
                else dense_ragged_all_to_all)
    # My kept rows sorted by expert: the ones for device p are contiguous.
    key_m = jnp.where(routing.kept, routing.expert_index, num_experts).reshape(-1)
    order_m = jnp.argsort(key_m, stable=True)
    token_m = order_m // k
    counts_pe = jnp.bincount(key_m, length=num_experts + 1)[:num_experts].reshape(
        em.expert_size, -1).astype(jnp.int32)
    send_p = jnp.sum(counts_pe, axis=1)
    send_offsets_p = exclusive_cumsum(send_p)
    # What each source sends me per local expert, and where my rows land on each
    # destination (after the rows of the sources before me).
    recv_counts_pe = jax.lax.all_to_all(counts_pe, axis, 0, 0, tiled=True)
    recv_p = jnp.sum(recv_counts_pe, axis=1)
    sent_pp = jax.lax.all_gather(send_p, axis)  # [source, destination]
    land_offsets_p = (jnp.cumsum(sent_pp, axis=0) - sent_pp)[
        jax.lax.axis_index(axis)]
    num_recv = em.expert_size * g * s * k
    x_rd = exchange(x_gsd.reshape(g * s, d)[token_m], jnp.zeros((num_recv, d),
                    x_gsd.dtype), send_offsets_p, send_p, land_offsets_p, recv_p,
                    axis_name=axis)
    # Regroup the received rows by local expert and run the experts.
    expert_r = local_expert_of_rows(recv_counts_pe, num_recv)
    order_r = jnp.argsort(expert_r, stable=True)
    group_sizes_e = jnp.sum(recv_counts_pe, axis=0)
    matmul = functools.partial(grouped_matmul, backend=self.backend, tile=self.tile
                               or auto_tile(num_recv, group_sizes_e.shape[0]))
    y_sorted = expert_mlp_grouped(kind, x_rd[order_r], join_wi_0(wi_0), wi_1, wo,
                                  group_sizes_e, matmul)
    y_rd = jnp.zeros_like(y_sorted).at[order_r].set(y_sorted, unique_indices=True)
    # Send each row back to where it came from in its source's sorted rows.
    back_offsets_p = jax.lax.all_to_all(send_offsets_p, axis, 0, 0, tiled=True)
    recv_offsets_p = exclusive_cumsum(recv_p)
    y_md = exchange(y_rd, jnp.zeros((g * s * k, d), y_rd.dtype), recv_offsets_p,
                    recv_p, back_offsets_p, send_p, axis_name=axis)
    gate_m = routing.gates.reshape(-1)[order_m].astype(y_md.dtype)
    y_nd = jnp.zeros((g * s, d), y_md.dtype).at[token_m].add(y_md * gate_m[:, None])
    if em.hidden_axes:  # split hidden units: partial sums
      y_nd = jax.lax.psum(y_nd, em.axis(em.hidden_axes))
    return y_nd.reshape(g, s, d)
