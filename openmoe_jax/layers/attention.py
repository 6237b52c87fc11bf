"""Multi-head self-attention with RoPE and a mask builder for packed sequences.

Mask kinds: "causal" (decoder LM), "prefix" (bidirectional inside an inputs prefix,
causal elsewhere: prefix LM / UL2) and "bidirectional" (masked diffusion). Every kind
respects packing: tokens of different segments never attend to each other.
"""
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from openmoe_jax.config import ATTENTION_KINDS
from openmoe_jax.layers.embeddings import apply_rope
from openmoe_jax.layers.norms import RMSNorm


def make_attention_mask(kind: str, length: int,
                        segment_ids_bt: Optional[jax.Array] = None,
                        prefix_bt: Optional[jax.Array] = None,
                        batch: int = 1) -> jax.Array:
  """Returns a bool mask [b, 1, t_q, t_k]: True where query may attend to key."""
  if kind not in ATTENTION_KINDS:
    raise ValueError(f"unknown attention kind {kind!r}; choose one of {ATTENTION_KINDS}")
  idx = jnp.arange(length)
  causal_tt = idx[:, None] >= idx[None, :]
  if kind == "causal":
    mask_btt = jnp.broadcast_to(causal_tt, (batch, length, length))
  elif kind == "bidirectional":
    mask_btt = jnp.ones((batch, length, length), bool)
  else:
    if prefix_bt is None:
      raise ValueError("attention kind 'prefix' needs prefix flags "
                       "(decoder_causal_attention)")
    prefix_bt = prefix_bt.astype(bool)
    both_prefix_btt = prefix_bt[:, :, None] & prefix_bt[:, None, :]
    mask_btt = causal_tt[None] | both_prefix_btt
  if segment_ids_bt is not None:
    mask_btt = mask_btt & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
  return mask_btt[:, None]


class Attention(nn.Module):
  """Self-attention: [b, t, d] -> [b, t, d]; scores and softmax in float32.

  Decoding: when `apply` makes the "cache" collection mutable, keys and values are
  appended to a cache (created at the length of the first such call) and queries
  attend causally to everything cached so far; `mask_b1tt` is then ignored (one
  sequence per row). `qk_norm`: RMSNorm over each head's queries and keys before
  RoPE (OpenMoE 2 / OLMo-style QK-norm), eps `norm_eps`. `scale_logits`: multiply
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

  def _proj(self, name, x_btd):
    d = x_btd.shape[-1]
    std = d ** -0.5
    if name == "query" and not self.scale_logits:
      std *= self.head_dim ** -0.5
    init = nn.initializers.normal(std)
    kernel = self.param(
        name, nn.with_logical_partitioning(init, ("embed", "heads", "kv")),
        (d, self.num_heads, self.head_dim), jnp.float32)
    return jnp.einsum("btd,dhk->bthk", x_btd, kernel.astype(self.dtype))

  @nn.compact
  def __call__(self, x_btd: jax.Array, positions_bt: jax.Array,
               mask_b1tt: jax.Array) -> jax.Array:
    q_bthk, k_bthk = self._proj("query", x_btd), self._proj("key", x_btd)
    if self.qk_norm:
      q_bthk = RMSNorm(self.norm_eps, self.dtype, "kv", name="query_norm")(q_bthk)
      k_bthk = RMSNorm(self.norm_eps, self.dtype, "kv", name="key_norm")(k_bthk)
    q_bthk = apply_rope(q_bthk, positions_bt, self.rope_base)
    k_bthk = apply_rope(k_bthk, positions_bt, self.rope_base)
    v_bthk = self._proj("value", x_btd)
    q_bthk = nn.with_logical_constraint(
        q_bthk, ("batch", "length", "act_heads", "act_kv"))
    if self.is_mutable_collection("cache") and not self.is_initializing():
      k_bthk, v_bthk, mask_b1tt = self._update_cache(k_bthk, v_bthk)
    scores_bhqk = jnp.einsum("bqhk,bshk->bhqs", q_bthk, k_bthk,
                             preferred_element_type=jnp.float32)
    if self.scale_logits:
      scores_bhqk = scores_bhqk * (self.head_dim ** -0.5)
    scores_bhqk = jnp.where(mask_b1tt, scores_bhqk, jnp.finfo(jnp.float32).min)
    probs_bhqk = jax.nn.softmax(scores_bhqk, axis=-1).astype(self.dtype)
    out_bthk = jnp.einsum("bhqs,bshk->bqhk", probs_bhqk, v_bthk)
    inner = self.num_heads * self.head_dim
    wo = self.param(
        "out", nn.with_logical_partitioning(
            nn.initializers.normal(inner ** -0.5), ("heads", "kv", "embed")),
        (self.num_heads, self.head_dim, x_btd.shape[-1]), jnp.float32)
    out_btd = jnp.einsum("bthk,hkd->btd", out_bthk, wo.astype(self.dtype))
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
