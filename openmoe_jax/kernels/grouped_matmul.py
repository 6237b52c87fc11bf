"""Grouped matmul: rows of `lhs` in contiguous groups, group e times `rhs[e]`.

`grouped_matmul(lhs_nd, rhs_edf, group_sizes_e, backend=...)` returns out [n, f] with
out[i] = lhs[i] @ rhs[e(i)] for the rows of group e (groups in order, starting at row
0) and zeros for the rows past sum(group_sizes_e). Backends:

- "ragged_dot": `jax.lax.ragged_dot`. Correct everywhere; on CPU jax lowers it by
  masking every group densely (E times the work and memory), on TPU/GPU it is a real
  grouped kernel.
- "padded": the CPU path. Each group is padded to a multiple of `tile` rows (static
  bound on the padded rows: n + E * (tile - 1)), and a loop over the used tile blocks
  multiplies each [tile, d] block by its expert's [d, f] weight. A custom VJP keeps
  the backward as cheap: lhs grad is the same grouped matmul against rhs transposed,
  rhs grad accumulates block by block into [E, d, f].
- "pallas": the TPU path, megablox's gmm / tgmm Pallas kernels (pallas_gmm.py), run
  in interpret mode off TPU.
"""
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from openmoe_jax.kernels.pallas_gmm import pallas_gmm

BACKENDS = ("ragged_dot", "padded", "pallas")


def grouped_matmul(lhs_nd: jax.Array, rhs_edf: jax.Array, group_sizes_e: jax.Array,
                   backend: str = "ragged_dot", tile: int = 128,
                   interpret: Optional[bool] = None) -> jax.Array:
  """Returns [n, f]: each group's rows times its rhs matrix (zeros past the groups)."""
  group_sizes_e = group_sizes_e.astype(jnp.int32)
  if backend == "ragged_dot":
    return jax.lax.ragged_dot(lhs_nd, rhs_edf, group_sizes_e)
  if backend == "padded":
    return _padded_gmm(lhs_nd, rhs_edf, group_sizes_e, tile)
  if backend == "pallas":
    return pallas_gmm(lhs_nd, rhs_edf, group_sizes_e, interpret=interpret)
  raise ValueError(f"grouped_matmul backend={backend!r}; choose one of {BACKENDS}")


class _Layout(NamedTuple):
  dest_n: jax.Array  # padded row of each lhs row (num_padded for rows past the groups)
  block_expert_b: jax.Array  # expert of each tile block
  used_blocks: jax.Array  # number of blocks holding rows
  num_padded: int  # static padded row count (a multiple of tile)


def _layout(n: int, group_sizes_e: jax.Array, tile: int) -> _Layout:
  """Returns where each row goes when every group is padded to a multiple of tile."""
  num_experts = group_sizes_e.shape[0]
  num_blocks = -(-(n + num_experts * (tile - 1)) // tile)
  blocks_e = (group_sizes_e + tile - 1) // tile
  block_end_e = jnp.cumsum(blocks_e)
  row_end_e = jnp.cumsum(group_sizes_e)
  shift_e = (block_end_e - blocks_e) * tile - (row_end_e - group_sizes_e)
  row_n = jnp.arange(n, dtype=jnp.int32)
  group_n = jnp.minimum(jnp.searchsorted(row_end_e, row_n, side="right"),
                        num_experts - 1)
  # Rows past the groups go out of bounds, each to its own index (kept unique).
  dest_n = jnp.where(row_n < row_end_e[-1], row_n + shift_e[group_n],
                     num_blocks * tile + row_n)
  block_b = jnp.arange(num_blocks, dtype=jnp.int32)
  block_expert_b = jnp.minimum(jnp.searchsorted(block_end_e, block_b, side="right"),
                               num_experts - 1).astype(jnp.int32)
  return _Layout(dest_n, block_expert_b, block_end_e[-1], num_blocks * tile)


def _to_blocks(x_nd: jax.Array, lay: _Layout, tile: int) -> jax.Array:
  """Returns x scattered into padded tile blocks [B, tile, d] (zeros at padding)."""
  x_pd = jnp.zeros((lay.num_padded, x_nd.shape[1]), x_nd.dtype)
  x_pd = x_pd.at[lay.dest_n].set(x_nd, mode="drop", unique_indices=True)
  return x_pd.reshape(-1, tile, x_nd.shape[1])


def _from_blocks(y_btf: jax.Array, lay: _Layout) -> jax.Array:
  """Returns the rows [n, f] of padded blocks back in lhs order (0 past the groups)."""
  y_pf = y_btf.reshape(-1, y_btf.shape[-1])
  return y_pf.at[lay.dest_n].get(mode="fill", fill_value=0)


def _block_matmul(x_btd: jax.Array, rhs_edf: jax.Array, lay: _Layout,
                  transpose_rhs: bool) -> jax.Array:
  """Returns [B, tile, f]: each used block times its expert's (transposed) rhs."""
  f = rhs_edf.shape[1] if transpose_rhs else rhs_edf.shape[2]
  dims = (((1,), (1 if transpose_rhs else 0,)), ((), ()))

  def body(b, y_btf):
    w_df = rhs_edf[lay.block_expert_b[b]]
    y_tf = jax.lax.dot_general(x_btd[b], w_df, dims,
                               preferred_element_type=jnp.float32)
    return jax.lax.dynamic_update_index_in_dim(y_btf, y_tf.astype(y_btf.dtype), b, 0)

  y_btf = jnp.zeros(x_btd.shape[:2] + (f,), x_btd.dtype)
  return jax.lax.fori_loop(0, lay.used_blocks, body, y_btf)


def _rhs_grad(x_btd: jax.Array, g_btf: jax.Array, lay: _Layout,
              rhs_shape, dtype) -> jax.Array:
  """Returns d rhs [E, d, f] = sum over each expert's blocks of x_block^T g_block."""
  def body(b, dw_edf):
    e = lay.block_expert_b[b]
    dw_df = jnp.einsum("td,tf->df", x_btd[b], g_btf[b],
                       preferred_element_type=jnp.float32)
    return dw_edf.at[e].add(dw_df)

  dw_edf = jnp.zeros(rhs_shape, jnp.float32)
  return jax.lax.fori_loop(0, lay.used_blocks, body, dw_edf).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _padded_gmm(lhs_nd, rhs_edf, group_sizes_e, tile):
  out, _ = _padded_fwd(lhs_nd, rhs_edf, group_sizes_e, tile)
  return out


def _padded_fwd(lhs_nd, rhs_edf, group_sizes_e, tile):
  lay = _layout(lhs_nd.shape[0], group_sizes_e, tile)
  x_btd = _to_blocks(lhs_nd, lay, tile)
  out_nf = _from_blocks(_block_matmul(x_btd, rhs_edf, lay, False), lay)
  return out_nf, (x_btd, rhs_edf, group_sizes_e)


def _padded_bwd(tile, res, g_nf):
  x_btd, rhs_edf, group_sizes_e = res
  lay = _layout(g_nf.shape[0], group_sizes_e, tile)
  g_btf = _to_blocks(g_nf, lay, tile)
  dlhs_nd = _from_blocks(_block_matmul(g_btf, rhs_edf, lay, True), lay)
  drhs_edf = _rhs_grad(x_btd, g_btf, lay, rhs_edf.shape, rhs_edf.dtype)
  return dlhs_nd.astype(x_btd.dtype), drhs_edf, None


_padded_gmm.defvjp(_padded_fwd, _padded_bwd)
