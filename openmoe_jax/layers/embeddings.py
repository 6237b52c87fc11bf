"""Token embedding and rotary position embedding (RoPE)."""
import flax.linen as nn
import jax
import jax.numpy as jnp


class Embed(nn.Module):
  """Token embedding table [vocab, d]; returns embeddings in `dtype`."""

  vocab_size: int
  d_model: int
  init_std: float = 1.0
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens_bt: jax.Array) -> jax.Array:
    table_vd = self.param(
        "embedding",
        nn.with_logical_partitioning(
            nn.initializers.normal(self.init_std), ("vocab", "embed")),
        (self.vocab_size, self.d_model), jnp.float32)
    x_btd = jnp.take(table_vd, tokens_bt, axis=0).astype(self.dtype)
    return nn.with_logical_constraint(x_btd, ("batch", "length", "act_embed"))


def apply_rope(x_bthk: jax.Array, positions_bt: jax.Array, base: float) -> jax.Array:
  """Returns x rotated by RoPE at `positions` (half-split layout), in x's dtype.

  Written as x * [cos, cos] + swap_halves(x) * [-sin, sin], the swap a flip of a
  [2, half] view: the same rotation as concatenating the two rotated halves, at
  less than half the CPU time fwd+bwd (1.75 vs 3.84 ms at [8, 256, 4, 64])."""
  head_dim = x_bthk.shape[-1]
  half = head_dim // 2
  inv_freq_k = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles_btk = positions_bt.astype(jnp.float32)[..., None] * inv_freq_k
  sin_bt1k = jnp.sin(angles_btk)[:, :, None, :]
  cos_bt1k = jnp.cos(angles_btk)[:, :, None, :]
  x = x_bthk.astype(jnp.float32)
  swapped = jnp.flip(x.reshape(x.shape[:-1] + (2, half)), -2).reshape(x.shape)
  rotated = (x * jnp.concatenate([cos_bt1k, cos_bt1k], -1)
             + swapped * jnp.concatenate([-sin_bt1k, sin_bt1k], -1))
  return rotated.astype(x_bthk.dtype)
