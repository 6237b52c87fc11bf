"""grouped_matmul backends against a NumPy per-group loop, forward and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.kernels.grouped_matmul import grouped_matmul


def _reference(lhs_nd, rhs_edf, group_sizes_e):
  """Returns the per-group products in float64 (zeros past the groups)."""
  out = np.zeros((lhs_nd.shape[0], rhs_edf.shape[2]))
  start = 0
  for e, size in enumerate(group_sizes_e):
    out[start:start + size] = lhs_nd[start:start + size] @ rhs_edf[e]
    start += size
  return out


def _reference_grads(lhs_nd, rhs_edf, group_sizes_e, g_nf):
  """Returns (d lhs, d rhs) of sum(out * g) by the per-group loop."""
  dlhs, drhs = np.zeros_like(lhs_nd), np.zeros_like(rhs_edf)
  start = 0
  for e, size in enumerate(group_sizes_e):
    rows = slice(start, start + size)
    dlhs[rows] = g_nf[rows] @ rhs_edf[e].T
    drhs[e] = lhs_nd[rows].T @ g_nf[rows]
    start += size
  return dlhs, drhs


GROUPS = {
    "empty_and_ragged": [0, 7, 3, 0, 9],  # sums to n
    "rows_past_groups": [2, 0, 5, 1, 4],  # 12 of 19 rows grouped
    "one_group": [0, 0, 19, 0, 0],
    "all_empty": [0, 0, 0, 0, 0],
}


@pytest.mark.parametrize("backend,tile", [("ragged_dot", 128), ("padded", 4),
                                          ("padded", 1), ("padded", 32),
                                          ("pallas", None)])
@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_backend_matches_per_group_loop(backend, tile, groups):
  rng = np.random.default_rng(len(groups))
  sizes = np.array(GROUPS[groups])
  n, d, f = 19, 5, 6
  lhs = rng.normal(size=(n, d)).astype(np.float32)
  rhs = rng.normal(size=(len(sizes), d, f)).astype(np.float32)
  g_nf = rng.normal(size=(n, f)).astype(np.float32)
  run = lambda a, b: grouped_matmul(a, b, jnp.asarray(sizes), backend=backend, tile=tile)
  out = jax.jit(run)(lhs, rhs)
  np.testing.assert_allclose(out, _reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
  dlhs, drhs = jax.jit(jax.grad(lambda a, b: jnp.sum(run(a, b) * g_nf), (0, 1)))(
      lhs, rhs)
  want_dlhs, want_drhs = _reference_grads(lhs, rhs, sizes, g_nf)
  np.testing.assert_allclose(dlhs, want_dlhs, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(drhs, want_drhs, rtol=1e-5, atol=1e-5)


def test_padded_bfloat16_matches_ragged_dot():
  rng = np.random.default_rng(3)
  sizes = jnp.array([5, 0, 11, 8])
  lhs = jnp.asarray(rng.normal(size=(24, 16)), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=(4, 16, 8)), jnp.bfloat16)
  got = grouped_matmul(lhs, rhs, sizes, backend="padded", tile=8)
  want = grouped_matmul(lhs, rhs, sizes, backend="ragged_dot")
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=5e-2)


def test_unknown_backend_is_rejected():
  with pytest.raises(ValueError, match="backend"):
    grouped_matmul(jnp.zeros((2, 3)), jnp.zeros((1, 3, 4)), jnp.array([2]), backend="x")
