"""Test oracle: a slow, loop-by-loop MoE reference in float64 NumPy.

Written to read like the papers, not like the vectorised code. Token choice: route
each group's (token, choice) pairs one at a time into experts until they are full,
in one of two orders: ST-MoE's (choice rank by choice rank, tokens in sequence order
within a rank) or position-major (token by token, each token's choices in rank
order). Capacity as ST-MoE (cf x T / E) or per choice (cf x k x T / E, Megatron).
Expert choice (OpenMoE 2): each expert walks its tokens from the highest score down
and takes the first C. Then sum the gated expert outputs.
"""
from typing import Dict, Optional, Tuple

import numpy as np

from openmoe_jax.config import MoeConfig
from openmoe_jax.moe.layer import router_of
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter


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


def reference_gates(logits_x, num_experts: int, kind: str):
  """Returns (routed scores [s, E], shared scores [s, S]) of logits [s, E + S]."""
  logits_x = np.asarray(logits_x, np.float64)
  if kind == "softmax":
    scores = np.exp(logits_x - logits_x.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
  else:
    scores = 1.0 / (1.0 + np.exp(-logits_x))
  return scores[:, :num_experts], scores[:, num_experts:]


def reference_token_choice(scores, top_k: int, capacity: int, renormalize=False,
                           batch_prioritized=False, scaling=1.0,
                           priority="choice_major"):
  """Returns (expert [s, k], kept [s, k], gates [s, k]) of one group's scores [s, E].

  "choice_major": choice rank by choice rank; within a rank tokens in sequence
  order, or by decreasing top-1 score (stable) when batch_prioritized.
  "position_major": token by token in sequence order, each token's choices in rank
  order. A choice whose expert already holds `capacity` choices drops.
  """
  s = len(scores)
  experts = np.array([np.argsort(-p, kind="stable")[:top_k] for p in scores])
  tokens = list(range(s))
  if batch_prioritized:
    tokens = sorted(tokens, key=lambda i: -scores[i, experts[i][0]])
  if priority == "choice_major":
    queue = [(i, rank) for rank in range(top_k) for i in tokens]
  elif priority == "position_major" and not batch_prioritized:
    queue = [(i, rank) for i in tokens for rank in range(top_k)]
  else:
    raise ValueError(f"no reference for priority={priority!r}, "
                     f"batch_prioritized={batch_prioritized}")
  kept = np.zeros((s, top_k), bool)
  gates = np.zeros((s, top_k))
  filled = [0] * scores.shape[1]
  for i, rank in queue:
    expert = experts[i][rank]
    if filled[expert] >= capacity:
      continue
    filled[expert] += 1
    kept[i, rank] = True
    gate = scores[i, expert]
    if renormalize:
      gate /= sum(scores[i, e] for e in experts[i])
    gates[i, rank] = gate * scaling
  return experts, kept, gates


def reference_token_capacity(cfg: MoeConfig, tokens_per_group: int, train: bool) -> int:
  """Returns the token-choice buffer size per expert for a group.

  Dropless: the whole group. ST-MoE: max(round(cf x T / E), min_capacity).
  Per choice (Megatron, OpenMoE 2): max(round(cf x k x T / E), min_capacity).
  """
  router = router_of(cfg)
  if router.dropless:
    return tokens_per_group
  cf = cfg.capacity_factor_train if train else cfg.capacity_factor_eval
  choices = tokens_per_group * (cfg.top_k if router.capacity_per_choice else 1)
  return max(int(round(cf * choices / cfg.num_experts)), cfg.min_capacity)


def reference_expert_choice(scores, capacity: int, unit_length: int, renormalize=False,
                            count_factors=None, scaling=1.0):
  """Returns (kept [s, E], gates [s, E]) of one group's scores [s, E].

  In each unit of `unit_length` consecutive tokens, every expert takes its
  `capacity` highest-scoring tokens (ties: the earlier token).
  """
  s, num_experts = scores.shape
  kept = np.zeros((s, num_experts), bool)
  for start in range(0, s, unit_length):
    for e in range(num_experts):
      ranked = sorted(range(start, start + unit_length), key=lambda i: -scores[i, e])
      for i in ranked[:capacity]:
        kept[i, e] = True
  gates = np.where(kept, scores, 0.0)
  for i in range(s):
    if renormalize and kept[i].any():
      gates[i] /= gates[i].sum()
    if count_factors is not None:
      gates[i] *= count_factors[kept[i].sum()]
  return kept, gates * scaling


def _route_group(scores, cfg: MoeConfig, train: bool, t: int):
  """Returns ([(token, expert, gate) served], dropped count, options) for one group."""
  s, num_experts = scores.shape
  router = router_of(cfg)
  cf = cfg.capacity_factor_train if train else cfg.capacity_factor_eval
  if isinstance(router, ExpertChoiceRouter):
    unit = t if router.level == "sequence" else s
    capacity = min(max(int(round(cf * cfg.top_k * unit / num_experts)), 1), unit)
    kept, gates = reference_expert_choice(
        scores, capacity, unit, cfg.renormalize_gates, router.count_scaling_factors,
        cfg.routed_scaling_factor)
    served = [(i, e, gates[i, e]) for i in range(s) for e in range(num_experts)
              if kept[i, e]]
    return served, int(np.sum(~kept.any(-1))), s
  experts, kept, gates = reference_token_choice(
      scores, cfg.top_k, reference_token_capacity(cfg, s, train),
      cfg.renormalize_gates, router.batch_prioritized, cfg.routed_scaling_factor,
      router.priority)
  served = [(i, experts[i, r], gates[i, r]) for i in range(s) for r in range(cfg.top_k)
            if kept[i, r]]
  return served, int(np.sum(~kept)), s * cfg.top_k


def reference_moe(x_btd, router_w_de, wi_0_edf, wi_1_edf, wo_efd, cfg: MoeConfig,
                  mlp_kind: str, train: bool, shared: Optional[Dict] = None
                  ) -> Tuple[np.ndarray, float]:
  """Returns (output [b, t, d], drop fraction) of the MoE layer for `cfg.router`.

  Drop fraction: of (token, choice) pairs for token choice, of tokens taken by no
  expert for expert choice. `shared`: the shared experts' params (`wi_0`, `wi_1`,
  `wo` with a leading shared axis, and `w_shared` [d, S] when gated).
  """
  t = np.shape(x_btd)[1]
  x_nd = np.asarray(x_btd, np.float64).reshape(-1, np.shape(x_btd)[-1])
  router_w_de, wi_0_edf, wi_1_edf, wo_efd = [
      np.asarray(a, np.float64) for a in (router_w_de, wi_0_edf, wi_1_edf, wo_efd)]
  shared = {k: np.asarray(v, np.float64) for k, v in (shared or {}).items()}
  n, num_experts = x_nd.shape[0], cfg.num_experts
  s = min(cfg.group_size, n)
  out_nd = np.zeros_like(x_nd)
  dropped = options = 0
  for start in range(0, n, s):
    x_sd = x_nd[start:start + s]
    logits = x_sd @ router_w_de
    if "w_shared" in shared:
      logits = np.concatenate([logits, x_sd @ shared["w_shared"]], axis=-1)
    scores, shared_scores = reference_gates(logits, num_experts, cfg.gate)
    served, group_dropped, group_options = _route_group(scores, cfg, train, t)
    dropped, options = dropped + group_dropped, options + group_options
    for i, expert, gate in served:
      out_nd[start + i] += gate * reference_mlp(
          mlp_kind, x_sd[i], wi_0_edf[expert], wi_1_edf[expert], wo_efd[expert])
    for j in range(len(shared.get("wo", []))):
      for i in range(s):
        gate = shared_scores[i, j] if "w_shared" in shared else 1.0
        out_nd[start + i] += gate * reference_mlp(
            mlp_kind, x_sd[i], shared["wi_0"][j], shared["wi_1"][j], shared["wo"][j])
  return out_nd.reshape(np.shape(x_btd)), dropped / options
