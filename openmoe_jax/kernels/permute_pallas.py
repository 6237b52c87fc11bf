"""Pallas TPU row-gather kernels behind kernels/permute.py (no autodiff here).

Both kernels walk blocks of output rows on a 1-D grid. Each block's row indices are
prefetched into SMEM by the pipeline (an SMEM-blocked input: whole-array scalar
prefetch would not fit TPU v3's 16 KiB of SMEM beyond a few thousand rows) and each
drives one row DMA from the source in HBM (left in place, `pl.ANY`) into VMEM; rows
with index -1 start no DMA and are zeroed afterwards with a vector mask (the indices
again, as a VMEM block).

Rows travel as 32-bit words: Mosaic cannot address one row of packed bf16 in VMEM,
so bf16 [n, d] is viewed as uint32 [n, d / 2] (two values per word); the combine
kernel unpacks each word into two float32 halves, accumulates, and rounds back to
bf16 (nearest even, as XLA's cast). A row of w words is laid out as `s` rows of
`lanes` words of a 2-D view [n * s, lanes]: s = 1, lanes = w (padded to 128) on TPU
v4+; on TPU v3, whose DMAs address HBM in 1 KiB words, lanes = 256 and s even.

- `gather_rows(x_nd, src_r)` -> [R, d]: out[r] = x[src_r[r]], zeros for src_r < 0.
- `combine_rows(y_rd, row_nk, gates_nk)` -> [n, d] (y dtype):
  out[t] = sum_j gates[t, j] * y[row_nk[t, j]], float32 accumulation, rows < 0 skipped.
"""
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from openmoe_jax.kernels import target

GATHER_BLOCK_ROWS = 64  # output rows per grid step (one DMA each)
COMBINE_BLOCK_TOKENS = 32  # tokens per grid step (k DMAs each)


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _block(num_rows: int, limit: int) -> int:
  """Returns the rows per block: `limit`, or all rows rounded up to 16 if fewer."""
  return min(limit, _round_up(max(num_rows, 1), 16))


class _View(NamedTuple):
  x_vl: jax.Array  # [n * s, lanes] 32-bit words
  s: int  # view rows per array row


def _split_default() -> bool:
  """Returns whether rows are split into 256-lane pieces (TPU v3)."""
  generation = target.tpu_generation()
  return generation is not None and generation < 4


def _to_view(x_nd: jax.Array, split: bool) -> _View:
  """Returns x as 32-bit words in the 2-D view (bf16 pairs -> uint32)."""
  n, d = x_nd.shape
  if x_nd.dtype.itemsize == 2:
    x_nd = jnp.pad(x_nd, ((0, 0), (0, d % 2)))
    x_nd = jax.lax.bitcast_convert_type(x_nd.reshape(n, -1, 2), jnp.uint32)
  elif x_nd.dtype.itemsize != 4:
    raise ValueError(f"permute kernels take 16- or 32-bit rows, got {x_nd.dtype}")
  words = x_nd.shape[1]
  padded = _round_up(words, 512 if split else 128)
  x_nw = jnp.pad(x_nd, ((0, 0), (0, padded - words)))
  if not split:
    return _View(x_nw, 1)
  return _View(x_nw.reshape(-1, 256), padded // 256)


def _from_view(w_vl: jax.Array, num_rows: int, dtype, d: int) -> jax.Array:
  """Returns the [num_rows, d] values of `dtype` held in the view (inverse of
  _to_view)."""
  w_nw = w_vl.reshape(num_rows, -1)
  if jnp.dtype(dtype).itemsize == 2:
    w_nw = w_nw[:, :-(-d // 2)]
    return jax.lax.bitcast_convert_type(w_nw, dtype).reshape(num_rows, -1)[:, :d]
  return w_nw[:, :d]


def _smem_block(size: int) -> pl.BlockSpec:
  """Returns the spec of an index array [blocks, 1, size] read one block per grid
  step into SMEM (3-D so the block's last two dims are whole: Mosaic's rule)."""
  return pl.BlockSpec((None, 1, size), lambda b: (b, 0, 0), memory_space=pltpu.SMEM)


def _interpret_arg(interpret: bool):
  """Returns pallas_call's interpret argument (TPU semantics, DMAs included)."""
  return pltpu.InterpretParams() if interpret else False


def _copy_row(src_hbm, dst, src_row, dst_row, s, sem):
  """Returns the async copy of array row src_row of src_hbm into row dst_row of dst
  (s view rows each)."""
  return pltpu.make_async_copy(src_hbm.at[pl.ds(pl.multiple_of(src_row * s, s), s)],
                               dst.at[pl.ds(pl.multiple_of(dst_row * s, s), s)], sem)


def _copy_rows(index_smem, src_hbm, dst, sem, *, block, k, s):
  """Copies src row index[i * k + j] into dst[j] row i for every block row i and
  choice j with an index >= 0 (dst[0] is dst itself when k is None)."""
  def each(fn):
    def body(i, carry):
      for j in range(k or 1):
        row = index_smem[0, i * (k or 1) + j]

        @pl.when(row >= 0)
        def _():
          fn(_copy_row(src_hbm, dst if k is None else dst.at[j], row, i, s, sem))
      return carry
    jax.lax.fori_loop(0, block, body, 0)

  each(lambda copy: copy.start())
  each(lambda copy: copy.wait())


def _gather_kernel(src_smem, src_vmem, x_hbm, out_vmem, sem, *, block, s):
  _copy_rows(src_smem, x_hbm, out_vmem, sem.at[0], block=block, k=None, s=s)
  valid = src_vmem[...] >= 0  # [block * s, 1]
  out_vmem[...] = jnp.where(valid, out_vmem[...], jnp.zeros_like(out_vmem))


def gather_rows(x_nd: jax.Array, src_r: jax.Array, interpret: bool,
                split: Optional[bool] = None) -> jax.Array:
  """Returns [R, d]: x[src_r[r]] per row r, zeros where src_r < 0.

  split: the TPU v3 layout (None: when the target is a v3).
  """
  num_rows, d = src_r.shape[0], x_nd.shape[1]
  view = _to_view(x_nd, _split_default() if split is None else split)
  s, lanes = view.s, view.x_vl.shape[1]
  block = _block(num_rows, GATHER_BLOCK_ROWS)
  padded = _round_up(num_rows, block)
  src_p = jnp.pad(src_r.astype(jnp.int32), (0, padded - num_rows), constant_values=-1)
  call = pl.pallas_call(
      functools.partial(_gather_kernel, block=block, s=s),
      out_shape=jax.ShapeDtypeStruct((padded * s, lanes), view.x_vl.dtype),
      grid=(padded // block,),
      in_specs=[_smem_block(block), pl.BlockSpec((block * s, 1), lambda b: (b, 0)),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((block * s, lanes), lambda b: (b, 0)),
      scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=_interpret_arg(interpret))
  out_vl = call(src_p.reshape(-1, 1, block), jnp.repeat(src_p, s)[:, None], view.x_vl)
  return _from_view(out_vl[:num_rows * s], num_rows, x_nd.dtype, d)


def _unpack_bf16(w_bw: jax.Array):
  """Returns (low, high) float32 values of the bf16 pairs packed in uint32 words."""
  low = jax.lax.bitcast_convert_type(w_bw << 16, jnp.float32)
  high = jax.lax.bitcast_convert_type(w_bw & jnp.uint32(0xFFFF0000), jnp.float32)
  return low, high


def _pack_bf16(low: jax.Array, high: jax.Array) -> jax.Array:
  """Returns uint32 words holding (low, high) rounded to bf16 (nearest even)."""
  def round_bits(x):
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) >> 16
  return round_bits(low) | (round_bits(high) << 16)


def _combine_kernel(row_smem, row_vmem, gates_vmem, y_hbm, out_vmem, buf_kbl, sem, *,
                    block, k, s, packed):
  _copy_rows(row_smem, y_hbm, buf_kbl, sem.at[0], block=block, k=k, s=s)
  rows, gates = row_vmem[...], gates_vmem[...]  # [block * s, k]
  acc = [jnp.zeros(out_vmem.shape, jnp.float32) for _ in range(2 if packed else 1)]
  for j in range(k):
    valid = rows[:, j:j + 1] >= 0
    value = jnp.where(valid, buf_kbl[j], jnp.zeros_like(buf_kbl[j]))
    parts = _unpack_bf16(value) if packed else (value.astype(jnp.float32),)
    gate = jnp.where(valid, gates[:, j:j + 1], 0.0)
    acc = [a + gate * part for a, part in zip(acc, parts)]
  out_vmem[...] = _pack_bf16(*acc) if packed else acc[0].astype(out_vmem.dtype)


def combine_rows(y_rd: jax.Array, row_nk: jax.Array, gates_nk: jax.Array,
                 interpret: bool, split: Optional[bool] = None) -> jax.Array:
  """Returns [n, d] (y dtype): sum_j gates[t, j] y[row_nk[t, j]] over rows >= 0.

  split: the TPU v3 layout (None: when the target is a v3).
  """
  (n, k), d = row_nk.shape, y_rd.shape[1]
  if y_rd.dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"combine kernel takes float32 or bfloat16 rows, got {y_rd.dtype}")
  view = _to_view(y_rd, _split_default() if split is None else split)
  s, lanes = view.s, view.x_vl.shape[1]
  block = _block(n, COMBINE_BLOCK_TOKENS)
  padded = _round_up(n, block)
  row_p = jnp.pad(row_nk.astype(jnp.int32), ((0, padded - n), (0, 0)),
                  constant_values=-1)
  gates_p = jnp.pad(gates_nk.astype(jnp.float32), ((0, padded - n), (0, 0)))
  spec = pl.BlockSpec((block * s, k), lambda b: (b, 0))
  call = pl.pallas_call(
      functools.partial(_combine_kernel, block=block, k=k, s=s,
                        packed=y_rd.dtype == jnp.bfloat16),
      out_shape=jax.ShapeDtypeStruct((padded * s, lanes), view.x_vl.dtype),
      grid=(padded // block,),
      in_specs=[_smem_block(block * k), spec, spec, pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((block * s, lanes), lambda b: (b, 0)),
      scratch_shapes=[pltpu.VMEM((k, block * s, lanes), view.x_vl.dtype),
                      pltpu.SemaphoreType.DMA((1,))],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=_interpret_arg(interpret))
  out_vl = call(row_p.reshape(-1, 1, block * k), jnp.repeat(row_p, s, axis=0),
                jnp.repeat(gates_p, s, axis=0), view.x_vl)
  return _from_view(out_vl[:n * s], n, y_rd.dtype, d)
