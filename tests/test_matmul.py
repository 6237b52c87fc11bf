"""rows_matmul: the 2-D token-row product against jnp.einsum (values and gradients)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.layers.matmul import rows_matmul

CASES = [  # (einsum, x shape, w shape, contracted dims)
    ("btd,df->btf", (2, 5, 6), (6, 7), 1),
    ("btd,dhk->bthk", (2, 5, 6), (6, 3, 4), 1),
    ("bthk,hkd->btd", (2, 5, 3, 4), (3, 4, 6), 2),
    ("nd,df->nf", (9, 6), (6, 7), 1),
]


@pytest.mark.parametrize("spec,x_shape,w_shape,contract", CASES)
def test_rows_matmul_equals_einsum(spec, x_shape, w_shape, contract):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
  w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
  ours = rows_matmul(x, w, contract)
  ref = jnp.einsum(spec, x, w, precision="highest")
  assert ours.shape == ref.shape
  np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
  ct = jnp.asarray(rng.standard_normal(ref.shape), jnp.float32)
  grads = jax.grad(lambda x, w: jnp.sum(rows_matmul(x, w, contract) * ct), (0, 1))(x, w)
  ref_grads = jax.grad(lambda x, w: jnp.sum(
      jnp.einsum(spec, x, w, precision="highest") * ct), (0, 1))(x, w)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_rows_matmul_keeps_the_requested_accumulation_type_and_checks_shapes():
  x = jnp.ones((2, 3, 4), jnp.bfloat16)
  w = jnp.ones((4, 5), jnp.bfloat16)
  assert rows_matmul(x, w, preferred_element_type=jnp.float32).dtype == jnp.float32
  assert rows_matmul(x, w).dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="disagree"):
    rows_matmul(x, jnp.ones((5, 4)))
