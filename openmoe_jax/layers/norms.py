"""RMSNorm (T5's layer norm: no mean subtraction, no bias)."""
import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
  """Scales x by 1/rms(x) (over the last axis) and a learned per-feature scale;
  math in float32. `axis_name` is the scale's logical axis ("kv" for QK-norm)."""

  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x_btd: jax.Array) -> jax.Array:
    scale_d = self.param(
        "scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
        (x_btd.shape[-1],), jnp.float32)
    x32 = x_btd.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * scale_d).astype(self.dtype)
