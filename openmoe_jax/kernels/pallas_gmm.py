"""Pallas TPU grouped matmul (megablox gmm / tgmm kernels) with the project's contract.

`pallas_gmm(lhs_nd, rhs_edf, group_sizes_e)` returns [n, f] with out[i] = lhs[i] @
rhs[e(i)] for the rows of group e and zeros for rows past sum(group_sizes_e), like
the other `grouped_matmul` backends. This module owns:

- the tiling (`choose_tiling`): tm from the mean group size (small groups waste less
  of each boundary tile), tk / tn the largest of 512 / 256 / 128 dividing the
  128-padded dims; m, k and n are zero-padded to the tiles and sliced back;
- dtypes: bf16 inputs stay bf16 (f32 accumulation) on TPU v4+, and are upcast to f32
  on TPU v3, whose Mosaic compiler rejects bf16 matmuls (`target.bf16_matmul_ok`);
- the custom VJP: forward gmm; lhs grad = gmm of the cotangent against rhs
  transposed; rhs grad = tgmm (lhs^T times the cotangent, group by group);
- zeroing the rows past the groups, which the kernels leave unwritten;
- interpret mode off TPU (`interpret=None`), so CPU tests run the same kernel.
"""
import functools
import importlib
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from openmoe_jax.kernels import target

# The package re-exports a function named `gmm`, so import the module by its path.
_mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

Tiling = Tuple[int, int, int]
_LANE = 128


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _lane_tile(size: int) -> int:
  """Returns the largest of 512 / 256 / 128 dividing size rounded up to 128."""
  padded = _round_up(size, _LANE)
  return next(t for t in (512, 256, _LANE) if padded % t == 0)


def choose_tiling(m: int, k: int, n: int, num_groups: int) -> Tiling:
  """Returns (tm, tk, tn) for an [m, k] x [E, k, n] grouped matmul.

  tm is the mean group size rounded down to a power of two within [128, 512]: each
  group boundary costs one extra (partly masked) tile visit, so many small groups
  want small tiles, few large ones want fewer grid steps. Below 128 rows tm is m
  rounded up to 16 (one tile, the full dimension, which Mosaic accepts for any
  layout; the transposed kernel puts m on the lanes, hence >= 128 otherwise).
  """
  if m <= _LANE:
    tm = _round_up(max(m, 1), 16)
  else:
    mean = max(m // max(num_groups, 1), 1)
    tm = min(max(1 << (mean.bit_length() - 1), _LANE), 512)
  return tm, _lane_tile(k), _lane_tile(n)


def _pad_to(x: jax.Array, shape) -> jax.Array:
  """Returns x zero-padded at the end of each dim to `shape` (x itself if equal)."""
  if tuple(x.shape) == tuple(shape):
    return x
  return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, shape)])


def _rows_in_groups(num_rows: int, group_sizes_e: jax.Array) -> jax.Array:
  """Returns [num_rows, 1] bool: whether each row lies within the groups."""
  total = jnp.sum(group_sizes_e)
  return (jnp.arange(num_rows, dtype=jnp.int32) < total)[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(lhs_md, rhs_edf, group_sizes_e, tiling, interpret):
  return _gmm_fwd(lhs_md, rhs_edf, group_sizes_e, tiling, interpret)[0]


def _gmm_fwd(lhs_md, rhs_edf, group_sizes_e, tiling, interpret):
  out_mf = _mb.gmm(lhs_md, rhs_edf, group_sizes_e, lhs_md.dtype, tiling,
                   interpret=interpret)
  return out_mf, (lhs_md, rhs_edf, group_sizes_e)


def _gmm_bwd(tiling, interpret, res, g_mf):
  lhs_md, rhs_edf, group_sizes_e = res
  tm, tk, tn = tiling
  g_mf = jnp.where(_rows_in_groups(g_mf.shape[0], group_sizes_e), g_mf, 0)
  dlhs_md = _mb.gmm(g_mf, rhs_edf, group_sizes_e, lhs_md.dtype, (tm, tn, tk),
                    transpose_rhs=True, interpret=interpret)
  dlhs_md = jnp.where(_rows_in_groups(dlhs_md.shape[0], group_sizes_e), dlhs_md, 0)
  drhs_edf = _mb.tgmm(lhs_md.swapaxes(0, 1), g_mf, group_sizes_e, rhs_edf.dtype,
                      tiling, num_actual_groups=rhs_edf.shape[0],
                      interpret=interpret)
  return dlhs_md, drhs_edf, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def pallas_gmm(lhs_nd: jax.Array, rhs_edf: jax.Array, group_sizes_e: jax.Array,
               tiling: Optional[Tiling] = None, interpret: Optional[bool] = None,
               upcast: Optional[bool] = None) -> jax.Array:
  """Returns [n, f] (the inputs' result dtype): group rows times their rhs, 0 past.

  tiling: (tm, tk, tn), None for `choose_tiling`. interpret: None runs the kernel in
  interpret mode unless the target is a TPU. upcast: compute in f32 (None: when
  the target cannot take bf16 matmuls, TPU v3).
  """
  n, d = lhs_nd.shape
  num_groups, _, f = rhs_edf.shape
  if interpret is None:
    interpret = not target.on_tpu()
  if upcast is None:
    upcast = not target.bf16_matmul_ok()
  out_dtype = jnp.result_type(lhs_nd.dtype, rhs_edf.dtype)
  compute = jnp.float32 if upcast or out_dtype != jnp.bfloat16 else jnp.bfloat16
  tm, tk, tn = tiling or choose_tiling(n, d, f, num_groups)
  m_pad, d_pad, f_pad = _round_up(n, tm), _round_up(d, tk), _round_up(f, tn)
  lhs_md = _pad_to(lhs_nd.astype(compute), (m_pad, d_pad))
  rhs_edf_p = _pad_to(rhs_edf.astype(compute), (num_groups, d_pad, f_pad))
  out_mf = _gmm(lhs_md, rhs_edf_p, group_sizes_e.astype(jnp.int32), (tm, tk, tn),
                bool(interpret))
  out_nf = jnp.where(_rows_in_groups(n, group_sizes_e), out_mf[:n, :f], 0)
  return out_nf.astype(out_dtype)
