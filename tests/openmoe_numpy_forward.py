"""Test oracle: OpenMoE v1's forward pass in NumPy, on t5x-named weights.

Written from ColossalAI's `modeling_openmoe.py` and flaxformer's semantics, sharing
no code with openmoe_jax: plain embedding lookup; per layer RMSNorm -> attention
with unscaled logits and RoPE (base 1e4, rotate_half layout, positions 0..t-1) ->
residual; then either the dense MLP or (every `moe_interval`-th layer) top-k softmax
routing without renormalisation (nothing dropped: the caller picks ample capacity)
followed by the extra dense MLP; final RMSNorm and the untied head. OpenMoE's MLP:
[x1, x2] = x @ wi_0; h = x1 * silu(x2) * (x @ wi_1); out = h @ wo.
"""
import numpy as np


def rms_norm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _mlp(x, wi_0, wi_1, wo):
  x1, x2 = np.split(x @ wi_0, 2, axis=-1)
  return (x1 * _silu(x2) * (x @ wi_1)) @ wo


def _rope(x_bthd, base=1e4):
  t, d = x_bthd.shape[1], x_bthd.shape[-1]
  timescale = base ** (np.arange(0, d, 2, dtype=np.float64) / d)
  angle = np.arange(t)[:, None] / timescale[None, :]
  angle = np.concatenate([angle, angle], axis=-1)[None, :, None, :]
  half = d // 2
  rotated = np.concatenate([-x_bthd[..., half:], x_bthd[..., :half]], axis=-1)
  return x_bthd * np.cos(angle) + rotated * np.sin(angle)


def _attention(x, w, prefix, num_heads, head_dim):
  b, t, _ = x.shape
  proj = lambda n: (x @ w[f"{prefix}/{n}/kernel"].reshape(x.shape[-1], -1)).reshape(
      b, t, num_heads, head_dim)
  q, k, v = _rope(proj("query")), _rope(proj("key")), proj("value")
  logits = np.einsum("bqhd,bkhd->bhqk", q, k)  # OpenMoE: no 1/sqrt(head_dim)
  logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1)
  return out @ w[f"{prefix}/out/kernel"].reshape(-1, x.shape[-1])


def _moe(x, w, prefix, top_k):
  logits = x @ w[f"{prefix}/router/router_weights/w/kernel"]
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  chosen = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]
  out = np.zeros_like(x)
  for e in range(probs.shape[-1]):
    gate = np.where((chosen == e).any(-1), probs[..., e], 0.0)[..., None]
    expert = _mlp(x, *(w[f"{prefix}/expert/{n}/kernel"][e] for n in ("wi_0", "wi_1", "wo")))
    out += gate * expert
  return out


def openmoe_logits(w, tokens_bt, *, num_layers, moe_interval, num_heads, head_dim,
                   top_k=2, eps=1e-6):
  """Returns float64 logits [b, t, V] of OpenMoE v1 with t5x-named weights `w`
  ({'decoder/layers_0/...': array}, names relative to `target`)."""
  w = {k: np.asarray(v, np.float64) for k, v in w.items()}
  x = w["token_embedder/embedding"][tokens_bt]
  for i in range(num_layers):
    p = f"decoder/layers_{i}"
    h = rms_norm(x, w[f"{p}/pre_self_attention_layer_norm/scale"], eps)
    x = x + _attention(h, w, f"{p}/self_attention", num_heads, head_dim)
    h = rms_norm(x, w[f"{p}/pre_mlp_layer_norm/scale"], eps)
    if (i + 1) % moe_interval == 0:
      x = x + _moe(h, w, f"{p}/mlp", top_k)
      h = rms_norm(x, w[f"{p}/pre_extra_mlp_layer_norm/scale"], eps)
      x = x + _mlp(h, *(w[f"{p}/extra_mlp/{n}/kernel"] for n in ("wi_0", "wi_1", "wo")))
    else:
      x = x + _mlp(h, *(w[f"{p}/mlp/{n}/kernel"] for n in ("wi_0", "wi_1", "wo")))
  x = rms_norm(x, w["decoder/decoder_norm/scale"], eps)
  return x @ w["decoder/logits_dense/kernel"]
