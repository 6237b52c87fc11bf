"""Slow, loop-by-loop MoE reference in float64 NumPy. Used by tests only.

Written to read like the ST-MoE description, not like the vectorised code: route each
group's tokens choice rank by choice rank, in sequence order, into experts until
they are full, then sum the gated expert outputs.
"""
from typing import Tuple

import numpy as np

from openmoe_jax.config import MoeConfig


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def reference_mlp(kind: str, x_d, wi_0, wi_1, wo):
  """Returns one gated MLP applied to a single token vector."""
  h0, h1 = x_d @ wi_0, x_d @ wi_1
  if kind == "swiglu":
    hidden = _silu(h0) * h1
  elif kind == "geglu":
    hidden = _gelu_tanh(h0) * h1
  else:
    half = h0.shape[-1] // 2
    hidden = h0[:half] * _silu(h0[half:]) * h1
  return hidden @ wo


def reference_moe(x_btd, router_w_de, wi_0_edf, wi_1_edf, wo_efd, cfg: MoeConfig,
                  mlp_kind: str, train: bool) -> Tuple[np.ndarray, float]:
  """Returns (output [b, t, d], fraction of (token, choice) pairs dropped)."""
  x_nd = np.asarray(x_btd, np.float64).reshape(-1, np.shape(x_btd)[-1])
  w = [np.asarray(a, np.float64) for a in (router_w_de, wi_0_edf, wi_1_edf, wo_efd)]
  router_w_de, wi_0_edf, wi_1_edf, wo_efd = w
  n, num_experts = x_nd.shape[0], cfg.num_experts
  s = min(cfg.group_size, n)
  cf = cfg.capacity_factor_train if train else cfg.capacity_factor_eval
  capacity = max(int(round(cf * s / num_experts)), cfg.min_capacity)
  out_nd = np.zeros_like(x_nd)
  dropped = 0
  for start in range(0, n, s):
    tokens = range(start, start + s)
    logits = x_nd[start:start + s] @ router_w_de
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    choices = [list(np.argsort(-p, kind="stable")[:cfg.top_k]) for p in probs]
    filled = [0] * num_experts
    for rank in range(cfg.top_k):
      for i, token in enumerate(tokens):
        expert = choices[i][rank]
        gate = probs[i, expert]
        if cfg.renormalize_gates:
          gate /= sum(probs[i, e] for e in choices[i])
        if filled[expert] >= capacity:
          dropped += 1
          continue
        filled[expert] += 1
        out_nd[token] += gate * reference_mlp(
            mlp_kind, x_nd[token], wi_0_edf[expert], wi_1_edf[expert], wo_efd[expert])
  return out_nd.reshape(np.shape(x_btd)), dropped / (n * cfg.top_k)
