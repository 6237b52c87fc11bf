"""apply_rope against RoPE as a complex rotation in NumPy (GPT-NeoX / LLaMA half-split
layout: dims j and j + half form the pair rotated by position x base^(-j / half))."""
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.layers.embeddings import apply_rope


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_apply_rope_is_a_complex_rotation_per_pair(dtype):
  rng = np.random.default_rng(0)
  b, t, h, k, base = 2, 7, 3, 8, 10000.0
  x = rng.standard_normal((b, t, h, k)).astype(np.float32)
  positions = rng.integers(0, 500, (b, t))
  half = k // 2
  theta_btj = positions[..., None] * base ** (-np.arange(half) / half)
  z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * theta_btj)[:, :, None, :]
  expected = np.concatenate([z.real, z.imag], -1)
  ours = apply_rope(jnp.asarray(x, dtype), jnp.asarray(positions), base)
  assert ours.dtype == dtype
  tol = 1e-4 if dtype == jnp.float32 else 5e-2
  np.testing.assert_allclose(np.asarray(ours, np.float32),
                             np.asarray(jnp.asarray(expected, dtype), np.float32),
                             rtol=tol, atol=tol)
