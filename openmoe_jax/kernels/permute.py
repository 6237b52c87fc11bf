"""Token permutation for dispatch: gather rows into expert order, combine them back.

Two index maps describe a dispatch of n tokens with k choices each into R rows:
`src_r` [R] (the token of each row, -1 for an empty row: capacity slot or padding)
and `row_nk` [n, k] (the row of each choice, -1 where the choice was not kept). They
must be inverse to each other: row_nk[t, j] = r exactly when src_r[r] = t.

- `permute(x_nd, src_r, row_nk)` -> [R, d]: out[r] = x[src_r[r]] (0 for empty rows).
- `combine(y_rd, row_nk, gates_nk, src_r)` -> [n, d]:
  out[t] = sum_j gates[t, j] * y[row_nk[t, j]] (kept choices only).

On TPU both run as Pallas kernels (permute_pallas.py) whose grid walks blocks of
output rows, each block's indices prefetched into SMEM to drive one row DMA each;
custom VJPs express each gradient with the other kernel (permute's is a combine with
unit gates, combine's y-grad a permute of the cotangent scaled per row, its gate grad
a permute of y dotted with the cotangent). Elsewhere an XLA gather serves, which
autodiff differentiates as a scatter-add. `interpret=True` forces the Pallas
kernels in interpret mode (tests); None picks by the target (`target.on_tpu`).
"""
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from openmoe_jax.kernels import permute_pallas, target


def use_pallas(interpret: Optional[bool]) -> bool:
  """Returns whether the Pallas kernels run: forced by interpret=True, else on TPU."""
  return bool(interpret) or target.on_tpu()


def permute(x_nd: jax.Array, src_r: jax.Array, row_nk: jax.Array,
            interpret: Optional[bool] = None) -> jax.Array:
  """Returns [R, d]: token rows in dispatch order, zeros for empty rows."""
  src_r, row_nk = src_r.astype(jnp.int32), row_nk.astype(jnp.int32)
  if use_pallas(interpret):
    return _permute(x_nd, src_r, row_nk, bool(interpret))
  return gather_rows_xla(x_nd, src_r)


def combine(y_rd: jax.Array, row_nk: jax.Array, gates_nk: jax.Array, src_r: jax.Array,
            interpret: Optional[bool] = None) -> jax.Array:
  """Returns [n, d] (y dtype): each token's kept rows summed, weighted by its gates."""
  src_r, row_nk = src_r.astype(jnp.int32), row_nk.astype(jnp.int32)
  if use_pallas(interpret):
    return _combine(y_rd, row_nk, gates_nk, src_r, bool(interpret))
  return combine_xla(y_rd, row_nk, gates_nk)


def gather_rows_xla(x_nd: jax.Array, src_r: jax.Array) -> jax.Array:
  """Returns x[src_r] with zeros where src_r < 0 (the XLA fallback of permute)."""
  n = x_nd.shape[0]
  safe_r = jnp.where(src_r < 0, n, src_r)  # out of bounds -> fill, not wrap-around
  return x_nd.at[safe_r].get(mode="fill", fill_value=0)


def combine_xla(y_rd: jax.Array, row_nk: jax.Array, gates_nk: jax.Array) -> jax.Array:
  """Returns sum_j gates[t, j] y[row[t, j]] (the XLA fallback of combine)."""
  n, k = row_nk.shape
  y_nkd = gather_rows_xla(y_rd, row_nk.reshape(-1)).reshape(n, k, -1)
  gates_nk = jnp.where(row_nk < 0, 0, gates_nk).astype(jnp.float32)
  out_nd = jnp.einsum("nkd,nk->nd", y_nkd.astype(jnp.float32), gates_nk)
  return out_nd.astype(y_rd.dtype)


def _row_gates(gates_nk: jax.Array, row_nk: jax.Array, num_rows: int) -> jax.Array:
  """Returns [R] float32: the gate of the choice held by each row (0 if empty)."""
  flat_row = jnp.where(row_nk < 0, num_rows, row_nk).reshape(-1)
  return jnp.zeros((num_rows,), jnp.float32).at[flat_row].set(
      gates_nk.reshape(-1).astype(jnp.float32), mode="drop")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _permute(x_nd, src_r, row_nk, interpret):
  return permute_pallas.gather_rows(x_nd, src_r, interpret)


def _permute_fwd(x_nd, src_r, row_nk, interpret):
  return _permute(x_nd, src_r, row_nk, interpret), (src_r, row_nk)


def _permute_bwd(interpret, res, g_rd):
  src_r, row_nk = res
  ones_nk = jnp.ones(row_nk.shape, jnp.float32)
  dx_nd = permute_pallas.combine_rows(g_rd, row_nk, ones_nk, interpret)
  return dx_nd, None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _combine(y_rd, row_nk, gates_nk, src_r, interpret):
  return permute_pallas.combine_rows(y_rd, row_nk, gates_nk, interpret)


def _combine_fwd(y_rd, row_nk, gates_nk, src_r, interpret):
  out_nd = _combine(y_rd, row_nk, gates_nk, src_r, interpret)
  return out_nd, (y_rd, row_nk, gates_nk, src_r)


def _combine_bwd(interpret, res, g_nd):
  y_rd, row_nk, gates_nk, src_r = res
  n, k = row_nk.shape
  gate_r = _row_gates(gates_nk, row_nk, y_rd.shape[0])
  g_rd = permute_pallas.gather_rows(g_nd, src_r, interpret)
  dy_rd = (g_rd.astype(jnp.float32) * gate_r[:, None]).astype(y_rd.dtype)
  y_nkd = permute_pallas.gather_rows(y_rd, row_nk.reshape(-1), interpret)
  dgates_nk = jnp.einsum("nkd,nd->nk", y_nkd.reshape(n, k, -1).astype(jnp.float32),
                         g_nd.astype(jnp.float32))
  return dy_rd, None, dgates_nk.astype(gates_nk.dtype), None


_combine.defvjp(_combine_fwd, _combine_bwd)
