"""Multi-head self-attention with RoPE; the attention itself is a gin-chosen
implementation (layers/attention_impls.py), the mask a description of its kind,
segments and prefix (layers/attention_mask.py, re-exported here).
"""
from typing import Any, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from openmoe_jax.layers.attention_impls import PlainAttention, attention_impl_of
from openmoe_jax.layers.attention_mask import (AttentionMask,  # noqa: F401
                                               make_attention_mask)
from openmoe_jax.layers.embeddings import apply_rope
from openmoe_jax.layers.matmul import rows_matmul
from openmoe_jax.layers.norms import RMSNorm


class Attention(nn.Module):
  """Self-attention: [b, t, d] -> [b, t, d]; scores and softmax in float32.

  Decoding: when `apply` makes the "cache" collection mutable, keys and values are
  appended to a cache (created at the length of the first such call) and queries
  attend causally to everything cached so far with `PlainAttention`; `mask` is then
  ignored (one sequence per row). `mask`: an `AttentionMask`, or a bool array
  [b, 1, t, t] (an explicit mask). `impl`: the attention implementation
  (`ModelConfig.attention_impl`; None: `AutoAttention()`). `qk_norm`: RMSNorm over
  each head's queries and keys before RoPE (OpenMoE 2 / OLMo-style QK-norm), eps
  `norm_eps`. `scale_logits`: multiply
  the logits by 1/sqrt(head_dim) (the usual choice); False computes unscaled
  logits as T5, flaxformer and OpenMoE v1 do, and folds the factor into the query
  initialisation instead (normal((d * head_dim)^-1/2)), so training from scratch
  starts from the same function.
  """

  num_heads: int
  head_dim: int
  rope_base: float = 10000.0
  dtype: jnp.dtype = jnp.float32
  qk_norm: bool = False
  norm_eps: float = 1e-6
  scale_logits: bool = True
  impl: Any = None

  def _proj(self, name, x_btd):
    d = x_btd.shape[-1]
    std = d ** -0.5
    if name == "query" and not self.scale_logits:
      std *= self.head_dim ** -0.5
    init = nn.initializers.normal(std)
    kernel = self.param(
        name, nn.with_logical_partitioning(init, ("embed", "heads", "kv")),
        (d, self.num_heads, self.head_dim), jnp.float32)
    return rows_matmul(x_btd, kernel.astype(self.dtype))

  @nn.compact
  def __call__(self, x_btd: jax.Array, positions_bt: jax.Array,
               mask: Union[AttentionMask, jax.Array]) -> jax.Array:
    q_bthk, k_bthk = self._proj("query", x_btd), self._proj("key", x_btd)
    if self.qk_norm:
      q_bthk = RMSNorm(self.norm_eps, self.dtype, "kv", name="query_norm")(q_bthk)
      k_bthk = RMSNorm(self.norm_eps, self.dtype, "kv", name="key_norm")(k_bthk)
    q_bthk = apply_rope(q_bthk, positions_bt, self.rope_base)
    k_bthk = apply_rope(k_bthk, positions_bt, self.rope_base)
    v_bthk = self._proj("value", x_btd)
    q_bthk = nn.with_logical_constraint(
        q_bthk, ("batch", "length", "act_heads", "act_kv"))
    if not isinstance(mask, AttentionMask):
      mask = AttentionMask.explicit(mask)
    scale = self.head_dim ** -0.5 if self.scale_logits else 1.0
    if self.is_mutable_collection("cache") and not self.is_initializing():
      k_bthk, v_bthk, mask_b1tl = self._update_cache(k_bthk, v_bthk)
      out_bthk = PlainAttention()(q_bthk, k_bthk, v_bthk,
                                  AttentionMask.explicit(mask_b1tl), scale)
    else:
      out_bthk = attention_impl_of(self.impl)(q_bthk, k_bthk, v_bthk, mask, scale)
    inner = self.num_heads * self.head_dim
    wo = self.param(
        "out", nn.with_logical_partitioning(
            nn.initializers.normal(inner ** -0.5), ("heads", "kv", "embed")),
        (self.num_heads, self.head_dim, x_btd.shape[-1]), jnp.float32)
    out_btd = rows_matmul(out_bthk, wo.astype(self.dtype), contract=2)
    return nn.with_logical_constraint(out_btd, ("batch", "length", "act_embed"))

  def _update_cache(self, k_bthk, v_bthk):
    """Writes this call's keys/values at the cache cursor; returns (all keys, all
    values, causal mask [b, 1, t, cache length] over the cache)."""
    cached_k = self.variable("cache", "key", jnp.zeros, k_bthk.shape, k_bthk.dtype)
    cached_v = self.variable("cache", "value", jnp.zeros, v_bthk.shape, v_bthk.dtype)
    cursor = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    b, t = k_bthk.shape[:2]
    start = cursor.value
    cached_k.value = jax.lax.dynamic_update_slice_in_dim(cached_k.value, k_bthk, start, 1)
    cached_v.value = jax.lax.dynamic_update_slice_in_dim(cached_v.value, v_bthk, start, 1)
    cursor.value = start + t
    length = cached_k.value.shape[1]
    visible_tl = jnp.arange(length)[None, :] <= (start + jnp.arange(t))[:, None]
    mask_b1tl = jnp.broadcast_to(visible_tl, (b, 1, t, length))
    return cached_k.value, cached_v.value, mask_b1tl
