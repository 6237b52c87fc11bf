"""cuDNN flash attention on a real GPU equals the plain attention, every mask kind.

CI has no GPU, so these tests skip there (the reason is outside our control); on a
machine with an NVIDIA GPU run them with the device visible:
`JAX_PLATFORMS=cuda python -m pytest -n 0 tests/test_gpu_attention.py`.
The CPU tests (test_attention_impls.py) check the same masks in float32, where the
GPU takes XLA's path; cuDNN serves only bf16/fp16, which is what these check.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.layers.attention_impls import PlainAttention, XlaDotProductAttention
from openmoe_jax.layers.attention_mask import AttentionMask
from test_attention_impls import T, _segments_bt  # the CPU tests' packed rows

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="needs an NVIDIA GPU (cuDNN); CI has none: run with JAX_PLATFORMS=cuda")

B, H, K = 2, 4, 64  # T = 256 tokens, as the CPU tests


def _mask(kind: str, packed: bool) -> AttentionMask:
  """Returns the mask; prefix: the first third of each row's tokens."""
  segments = jnp.asarray(_segments_bt()) if packed else None
  prefix = None
  if kind == "prefix":
    prefix = jnp.asarray((np.arange(T) < T // 3)[None].repeat(B, 0).astype(np.int32))
  return AttentionMask.build(kind, segments, prefix)


def _outputs_and_grads(impl, mask, qkv):
  """Returns (out, d sum(out * w) / d (q, k, v)) in float32."""
  w = jax.random.normal(jax.random.PRNGKey(9), (B, T, H, K))
  def loss(q, k, v):
    return jnp.sum(impl(q, k, v, mask, K ** -0.5).astype(jnp.float32) * w)
  out = jax.jit(lambda q, k, v: impl(q, k, v, mask, K ** -0.5))(*qkv)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*qkv)
  return [np.asarray(x, np.float32) for x in (out, *grads)]


@pytest.mark.parametrize("kind,packed", [("causal", False), ("causal", True),
                                         ("prefix", True), ("bidirectional", False),
                                         ("bidirectional", True)])
def test_cudnn_equals_plain_attention_in_bf16(kind, packed):
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  qkv = [jax.random.normal(key, (B, T, H, K), jnp.bfloat16) for key in keys]
  mask = _mask(kind, packed)
  got = _outputs_and_grads(XlaDotProductAttention("cudnn"), mask, qkv)
  # The reference: the plain einsums on the same bf16 inputs upcast to float32.
  want = _outputs_and_grads(PlainAttention(), mask,
                            [x.astype(jnp.float32) for x in qkv])
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    scale = float(np.max(np.abs(w)))
    np.testing.assert_allclose(g, w, rtol=0, atol=3e-2 * scale, err_msg=name)
    # Not merely close in the max: the error is bf16 rounding, not a wrong mask.
    assert np.mean(np.abs(g - w)) < 5e-3 * scale, name
