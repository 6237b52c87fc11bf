"""kernels/block_mlp.py (the chunked expert MLP) against a NumPy per-row loop, forward
and gradients, on layouts that exercise every chunk size and the run-past rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.kernels.block_mlp import ChunkSizes, chunked_expert_mlp, expert_rows


def _silu(z):
  return z / (1.0 + np.exp(-z))


def _reference(x_nd, source_p, w0, w1, w2, rows_e, ct_pd):
  """Returns (y [P, d] on owned rows, zeros elsewhere; d x; d w0; d w1; d w2) of
  sum(y * ct) by a float64 loop over rows (swiglu: silu(x w0) * (x w1) then wo)."""
  x_nd, w0, w1, w2, ct_pd = (np.asarray(a, np.float64) for a in (x_nd, w0, w1, w2, ct_pd))
  y = np.zeros(ct_pd.shape)
  dx, d0, d1, d2 = (np.zeros_like(a) for a in (x_nd, w0, w1, w2))
  row = 0
  for e, count in enumerate(rows_e):
    for p in range(row, row + count):
      x = x_nd[source_p[p]]
      h0, h1 = x @ w0[e], x @ w1[e]
      sig = 1.0 / (1.0 + np.exp(-h0))
      a = _silu(h0) * h1
      y[p] = a @ w2[e]
      g = ct_pd[p]
      d2[e] += np.outer(a, g)
      da = w2[e] @ g
      dh0 = da * h1 * (sig * (1.0 + h0 * (1.0 - sig)))
      dh1 = da * _silu(h0)
      d0[e] += np.outer(x, dh0)
      d1[e] += np.outer(x, dh1)
      dx[source_p[p]] += w0[e] @ dh0 + w1[e] @ dh1
    row += count
  return y, dx, d0, d1, d2


# rows per expert: empty experts, a one-row expert before a large one (its chunk runs
# over the whole next expert), exact multiples of the big chunk, every remainder
# size (1..big-1 rows: small chunks 4/2, or one more big chunk).
LAYOUTS = {
    "ragged": [0, 1, 13, 0, 8, 3, 16, 5, 0],
    "exact_big_chunks": [8, 16, 24],
    "all_remainders": list(range(1, 9)),
    "one_expert": [0, 0, 21],
    "all_empty": [0, 0, 0],
}


@pytest.mark.parametrize("sizes", [ChunkSizes(8, 2), ChunkSizes(4, 4), ChunkSizes(16, 1)])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_matches_per_row_loop(layout, sizes):
  rows_e = np.array(LAYOUTS[layout])
  num_rows, n, d, f = int(rows_e.sum()), 11, 5, 6
  rng = np.random.default_rng(len(rows_e) + sizes.big)
  num_padded = num_rows + sizes.big
  # Every row reads some token (repeats included); the spare rows read token 0.
  source_p = np.concatenate([rng.integers(0, n, num_rows),
                             np.zeros(sizes.big, int)]).astype(np.int32)
  x_nd = rng.normal(size=(n, d)).astype(np.float32)
  w0, w1 = rng.normal(size=(2, len(rows_e), d, f)).astype(np.float32)
  w2 = rng.normal(size=(len(rows_e), f, d)).astype(np.float32)
  owned = (np.arange(num_padded) < num_rows)[:, None]
  ct_pd = (rng.normal(size=(num_padded, d)) * owned).astype(np.float32)
  lay = expert_rows(jnp.asarray(rows_e))

  def loss(x, a, b, c):
    y = chunked_expert_mlp(x, jnp.asarray(source_p), a, b, c, lay, sizes, "swiglu")
    return jnp.sum(y * ct_pd), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(
      x_nd, w0, w1, w2)
  want_y, *want_grads = _reference(x_nd, source_p, w0, w1, w2, rows_e, ct_pd)
  np.testing.assert_allclose(np.asarray(y) * owned, want_y, rtol=1e-4, atol=1e-4)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_openmoe_swiglu_halves_and_bfloat16():
  """OpenMoE's SwiGLU (wi_0 holds two halves) and bfloat16 compute agree with the
  layer's own math on each expert's rows."""
  from openmoe_jax.layers.mlp import gated_hidden
  rows_e = np.array([3, 0, 9, 4])
  n, d, f = 7, 8, 4
  rng = np.random.default_rng(0)
  source_p = np.concatenate([rng.integers(0, n, 16), np.zeros(8, int)]).astype(np.int32)
  x_nd = rng.normal(size=(n, d)).astype(np.float32)
  w0 = rng.normal(size=(4, d, 2 * f)).astype(np.float32)
  w1 = rng.normal(size=(4, d, f)).astype(np.float32)
  w2 = rng.normal(size=(4, f, d)).astype(np.float32)
  expert_p = np.repeat(np.arange(4), rows_e)
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)):
    cast = lambda a: jnp.asarray(a, dtype)
    y = chunked_expert_mlp(cast(x_nd), jnp.asarray(source_p), cast(w0), cast(w1),
                           cast(w2), expert_rows(jnp.asarray(rows_e)), ChunkSizes(8, 2),
                           "openmoe_swiglu")
    assert y.dtype == dtype
    x_pd = x_nd[source_p[:16]]
    h0 = np.einsum("pd,pdf->pf", x_pd, w0[expert_p])
    h1 = np.einsum("pd,pdf->pf", x_pd, w1[expert_p])
    want = np.einsum("pf,pfd->pd", np.asarray(gated_hidden("openmoe_swiglu", h0, h1)),
                     w2[expert_p])
    np.testing.assert_allclose(np.asarray(y[:16], np.float32), want, rtol=tol,
                               atol=tol * np.abs(want).max())
