"""kernels/block_mlp.py (the chunked expert FFN: gather, expert MLP, gate-weighted
combine) against a NumPy per-row loop, forward and gradients, on layouts that
exercise every chunk size and the rows a chunk runs past."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.kernels.block_mlp import (ChunkSizes, _for_chunks, chunked_expert_ffn,
                                           expert_rows)


def _silu(z):
  return z / (1.0 + np.exp(-z))


def _reference(x_nd, source_p, gate_p, w0, w1, w2, rows_e, ct_nd):
  """Returns (out [n, d]; d x; d gate [P]; d w0; d w1; d w2) of sum(out * ct) by a
  float64 loop over the owned rows (swiglu: silu(x w0) * (x w1), then wo; row p
  adds gate_p[p] x its output to token source_p[p])."""
  x_nd, w0, w1, w2, ct_nd = (np.asarray(a, np.float64) for a in (x_nd, w0, w1, w2, ct_nd))
  out = np.zeros(x_nd.shape)
  dx, d0, d1, d2 = (np.zeros_like(a) for a in (x_nd, w0, w1, w2))
  dgate = np.zeros(len(source_p))
  row = 0
  for e, count in enumerate(rows_e):
    for p in range(row, row + count):
      i, gate = source_p[p], float(gate_p[p])
      x = x_nd[i]
      h0, h1 = x @ w0[e], x @ w1[e]
      sig = 1.0 / (1.0 + np.exp(-h0))
      a = _silu(h0) * h1
      y = a @ w2[e]
      out[i] += gate * y
      dgate[p] = y @ ct_nd[i]
      g = gate * ct_nd[i]
      d2[e] += np.outer(a, g)
      da = w2[e] @ g
      dh0 = da * h1 * (sig * (1.0 + h0 * (1.0 - sig)))
      dh1 = da * _silu(h0)
      d0[e] += np.outer(x, dh0)
      d1[e] += np.outer(x, dh1)
      dx[i] += w0[e] @ dh0 + w1[e] @ dh1
    row += count
  return out, dx, dgate, d0, d1, d2


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
  # Every row reads some token (repeats included); the spare rows read token 0
  # with a nonzero gate (the kernel must ignore both).
  source_p = np.concatenate([rng.integers(0, n, num_rows),
                             np.zeros(sizes.big, int)]).astype(np.int32)
  gate_p = rng.uniform(0.5, 1.5, num_rows + sizes.big).astype(np.float32)
  x_nd = rng.normal(size=(n, d)).astype(np.float32)
  w0, w1 = rng.normal(size=(2, len(rows_e), d, f)).astype(np.float32)
  w2 = rng.normal(size=(len(rows_e), f, d)).astype(np.float32)
  ct_nd = rng.normal(size=(n, d)).astype(np.float32)
  lay = expert_rows(jnp.asarray(rows_e))

  def loss(x, gates, a, b, c):
    out = chunked_expert_ffn(x, jnp.asarray(source_p), gates, a, b, c, lay, sizes,
                             "swiglu")
    return jnp.sum(out * ct_nd), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3, 4), has_aux=True))(
      x_nd, gate_p, w0, w1, w2)
  want_out, *want_grads = _reference(x_nd, source_p, gate_p, w0, w1, w2, rows_e, ct_nd)
  np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_openmoe_swiglu_halves_and_bfloat16():
  """OpenMoE's SwiGLU (wi_0 holds two halves) and bfloat16 compute agree with the
  layer's own math (gated_hidden) on each expert's rows."""
  from openmoe_jax.layers.mlp import gated_hidden
  rows_e = np.array([3, 0, 9, 4])
  n, d, f = 16, 8, 4
  rng = np.random.default_rng(0)
  # One row per token, so each token's output is one row's.
  source_p = np.concatenate([rng.permutation(n), np.full(8, n)]).astype(np.int32)
  gate_p = np.concatenate([rng.uniform(0.5, 1.5, n), np.ones(8)]).astype(np.float32)
  x_nd = np.concatenate([rng.normal(size=(n, d)), np.zeros((1, d))]).astype(np.float32)
  w0 = rng.normal(size=(4, d, 2 * f)).astype(np.float32)
  w1 = rng.normal(size=(4, d, f)).astype(np.float32)
  w2 = rng.normal(size=(4, f, d)).astype(np.float32)
  expert_p = np.repeat(np.arange(4), rows_e)
  x_pd = x_nd[source_p[:n]]
  h0 = np.einsum("pd,pdf->pf", x_pd, w0[expert_p])
  h1 = np.einsum("pd,pdf->pf", x_pd, w1[expert_p])
  y_pd = np.einsum("pf,pfd->pd", np.asarray(gated_hidden("openmoe_swiglu", h0, h1)),
                   w2[expert_p])
  want = np.zeros((n + 1, d))
  want[source_p[:n]] = y_pd * gate_p[:n, None]
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)):
    cast = lambda a: jnp.asarray(a, dtype)
    out = chunked_expert_ffn(cast(x_nd), jnp.asarray(source_p), jnp.asarray(gate_p),
                             cast(w0), cast(w1), cast(w2),
                             expert_rows(jnp.asarray(rows_e)), ChunkSizes(8, 2),
                             "openmoe_swiglu")
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=tol,
                               atol=tol * np.abs(want).max())


# (rows, chunks as (size, first row offset)) with big 128 and small 16, worked out
# by hand from the module docstring: chunks of 128 while 128 rows remain; the rest,
# rounded up to 16, is one more 128 chunk when over 64, else its binary digits from
# 64 down to 16, largest first.
SCHEDULES = [
    (0, []),
    (1, [(16, 0)]),
    (16, [(16, 0)]),
    (64, [(64, 0)]),
    (65, [(128, 0)]),  # rest 80 > 64: one more big chunk
    (112, [(128, 0)]),
    (128, [(128, 0)]),
    (143, [(128, 0), (16, 128)]),  # rest 15 -> 16
    (200, [(128, 0), (128, 128)]),  # rest 72 -> 80 > 64
    (300, [(128, 0), (128, 128), (32, 256), (16, 288)]),  # rest 44 -> 48 = 32 + 16
    (447, [(128, 0), (128, 128), (128, 256), (64, 384)]),  # rest 63 -> 64
]


@pytest.mark.parametrize("rows,want", SCHEDULES)
def test_chunk_schedule_is_the_documented_one(rows, want):
  """The chunks an expert's rows run in: few, large products and at most `small` - 1
  rows of padding below big / 2 (a wrong plan still gives the right values, since
  run-past rows get a zero gate, so only this test sees it)."""
  start = 1000

  def record(size, row, state):
    log_c2, n = state
    return log_c2.at[n].set(jnp.stack([jnp.int32(size), row])), n + 1

  run = jax.jit(lambda start, rows: _for_chunks(
      start, rows, ChunkSizes(128, 16), record,
      (jnp.full((16, 2), -1, jnp.int32), jnp.int32(0))))
  log_c2, n = run(jnp.int32(start), jnp.int32(rows))
  got = [(int(size), int(row) - start) for size, row in np.asarray(log_c2)[:int(n)]]
  assert got == want
