"""The OpenMoE routing analyses on RoutingRecords; each returns plain (JSON-able) data.

- `token_specialization`: is routing decided by token id or by position?
- `drop_by_position`: are choices late in a sequence dropped more (per task, layer)?
- `routing_stability`: do tokens keep their expert across checkpoints?
- `domain_load`: does each task load the experts differently?

Scores use the first (top-1) choice of each token unless said otherwise.
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from openmoe_jax.analysis.record import RoutingRecord


def _group_counts(labels_n: np.ndarray, expert_n: np.ndarray, num_experts: int
                  ) -> Tuple[np.ndarray, np.ndarray]:
  """Returns (distinct labels [G], counts [G, E] of experts per label)."""
  values, inverse = np.unique(labels_n, return_inverse=True)
  flat = np.bincount(inverse * num_experts + expert_n.astype(np.int64),
                     minlength=len(values) * num_experts)
  return values, flat.reshape(len(values), num_experts)


def _entropy_bits(counts: np.ndarray) -> np.ndarray:
  """Returns the entropy (bits) of each row of `counts` (last axis)."""
  total = np.maximum(counts.sum(-1, keepdims=True), 1)
  p = counts / total
  return -np.sum(np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def _information(labels_n, expert_n, num_experts) -> Tuple[float, float, float]:
  """Returns (H(E), I(E; label), modal consistency) from plug-in estimates, bits."""
  _, counts_ge = _group_counts(labels_n, expert_n, num_experts)
  n_g = counts_ge.sum(-1)
  h = float(_entropy_bits(counts_ge.sum(0)))
  h_cond = float(np.sum(n_g * _entropy_bits(counts_ge)) / n_g.sum())
  return h, h - h_cond, float(counts_ge.max(-1).sum() / n_g.sum())


def explained_routing(labels_n: np.ndarray, expert_n: np.ndarray, num_experts: int,
                      rng: np.random.Generator, permutations: int = 3) -> Dict[str, float]:
  """Returns how much of the expert choice a label (token id, position) explains.

  `score`: chance-corrected fraction of routing entropy removed by conditioning on
  the label, (I - I_null) / (H - I_null), where I_null is the mutual information
  with the labels shuffled (plug-in estimates are biased up for many rare labels).
  1: the label determines the expert; ~0: independent. `consistency`: share of
  tokens routed to their label's most common expert; `consistency_chance`: the same
  with shuffled labels. With no tokens (none frequent enough), all but the entropy
  are NaN: nothing was measured.
  """
  if not np.size(labels_n):
    nan = float("nan")
    return {"entropy_bits": 0.0, "mutual_information_bits": nan,
            "mutual_information_null_bits": nan, "score": nan, "consistency": nan,
            "consistency_chance": nan}
  h, info, consistency = _information(labels_n, expert_n, num_experts)
  nulls = [_information(rng.permutation(labels_n), expert_n, num_experts)
           for _ in range(permutations)]
  info_null = float(np.mean([x[1] for x in nulls]))
  denom = h - info_null
  return {"entropy_bits": h, "mutual_information_bits": info,
          "mutual_information_null_bits": info_null,
          "score": float((info - info_null) / denom) if denom > 1e-12 else 0.0,
          "consistency": consistency,
          "consistency_chance": float(np.mean([x[2] for x in nulls]))}


def _frequent_mask(token_n: np.ndarray, min_count: int) -> np.ndarray:
  _, inverse, counts = np.unique(token_n, return_inverse=True, return_counts=True)
  return counts[inverse] >= min_count


def token_specialization(record: RoutingRecord, min_count: int = 5,
                         position_field: str = "doc_position", top_tokens: int = 30,
                         tokens_per_expert: int = 10,
                         decode: Optional[Callable[[int], str]] = None,
                         seed: int = 0) -> Dict:
  """Returns token-id vs position specialization of the top-1 choice per MoE layer.

  Only tokens whose id occurs >= `min_count` times count (`coverage`: their share).
  Keys: `token_score`, `position_score` (means over layers of `explained_routing`
  scores), `per_layer` (full `explained_routing` dicts for token id and position),
  `token_expert_distribution` (per layer, the `top_tokens` most frequent ids and
  their distribution over experts [top_tokens, E]) and `top_tokens_per_expert` (per
  layer and expert, the most frequent ids whose most common expert it is, with
  count and share routed there).
  """
  decode = decode or str
  rng = np.random.default_rng(seed)
  mask = _frequent_mask(record.token, min_count)
  token_n, position_n = record.token[mask], getattr(record, position_field)[mask]
  num_experts = record.num_experts
  per_layer, distributions, owners = [], [], []
  for l in range(record.num_layers):
    expert_n = record.expert[l, mask, 0]
    per_layer.append({
        "layer": record.moe_layers[l],
        "token": explained_routing(token_n, expert_n, num_experts, rng),
        "position": explained_routing(position_n, expert_n, num_experts, rng)})
    ids, counts_ge = _group_counts(token_n, expert_n, num_experts)
    n_g = counts_ge.sum(-1)
    top = np.argsort(-n_g, kind="stable")[:top_tokens]
    distributions.append({
        "layer": record.moe_layers[l], "token_ids": ids[top].tolist(),
        "text": [decode(int(i)) for i in ids[top]], "counts": n_g[top].tolist(),
        "distribution": (counts_ge[top] / n_g[top, None]).round(4).tolist()})
    modal_g = counts_ge.argmax(-1)
    experts = []
    for e in range(num_experts):
      own = np.nonzero(modal_g == e)[0]
      own = own[np.argsort(-counts_ge[own, e], kind="stable")][:tokens_per_expert]
      experts.append([{"token_id": int(ids[g]), "text": decode(int(ids[g])),
                       "count": int(counts_ge[g, e]),
                       "share": round(float(counts_ge[g, e] / n_g[g]), 4)} for g in own])
    owners.append({"layer": record.moe_layers[l], "experts": experts})
  return {
      "min_count": min_count, "position_field": position_field,
      "coverage": float(mask.mean()) if mask.size else 0.0,
      "token_score": float(np.mean([x["token"]["score"] for x in per_layer])),
      "position_score": float(np.mean([x["position"]["score"] for x in per_layer])),
      "per_layer": per_layer, "token_expert_distribution": distributions,
      "top_tokens_per_expert": owners}


def _bucket_rates(position_n: np.ndarray, dropped_n: np.ndarray, edges: np.ndarray
                  ) -> List[Optional[float]]:
  """Returns the mean of `dropped_n` per bucket [edges[i], edges[i+1]); None if empty."""
  bucket_n = np.searchsorted(edges, position_n, side="right") - 1
  rates = []
  for b in range(len(edges) - 1):
    sel = dropped_n[bucket_n == b]
    rates.append(float(sel.mean()) if sel.size else None)
  return rates


def drop_by_position(record: RoutingRecord, num_buckets: int = 8,
                     position_field: str = "position") -> Dict:
  """Returns drop rates of (token, choice) pairs by position bucket.

  Keys: `bucket_edges` (num_buckets + 1 positions), `by_task` {task: [rate per
  bucket]} (all MoE layers), `by_layer` {layer: [rate per bucket]} (all tasks),
  `by_task_layer` {task: {layer: [...]}}, `by_choice_rank` {"1": [...], ...} (all
  tasks and layers), `overall_by_task` {task: rate}, `first_quarter_by_task`
  (positions < 1/4 of the sequence length) and `last_quarter_by_task` (positions
  >= 3/4). Compare records of the two token-choice priorities (`openmoe-analyze
  --priority`) to see how much of the late drop the slot order causes.
  """
  edges = np.linspace(0, record.sequence_length, num_buckets + 1).round().astype(int)
  position_n = getattr(record, position_field)
  dropped_lnk = ~record.kept
  layers = [str(x) for x in record.moe_layers]
  quarters = {"first_quarter_by_task": position_n < 0.25 * record.sequence_length,
              "last_quarter_by_task": position_n >= 0.75 * record.sequence_length}
  result = {"position_field": position_field, "bucket_edges": edges.tolist(),
            "by_task": {}, "by_layer": {}, "by_task_layer": {},
            "overall_by_task": {}, **{key: {} for key in quarters}}
  # Per token: mean drop over layers and choices, so each token weighs the same.
  dropped_n = dropped_lnk.mean(axis=(0, 2))
  for t, task in enumerate(record.task_names):
    sel = record.task == t
    result["by_task"][task] = _bucket_rates(position_n[sel], dropped_n[sel], edges)
    result["overall_by_task"][task] = float(dropped_n[sel].mean()) if sel.any() else None
    for key, part_n in quarters.items():
      part = sel & part_n
      result[key][task] = float(dropped_n[part].mean()) if part.any() else None
    result["by_task_layer"][task] = {
        name: _bucket_rates(position_n[sel], dropped_lnk[l, sel].mean(-1), edges)
        for l, name in enumerate(layers)}
  for l, name in enumerate(layers):
    result["by_layer"][name] = _bucket_rates(position_n, dropped_lnk[l].mean(-1), edges)
  # 1st choices are served before any 2nd choice: their drops are the telling ones.
  result["by_choice_rank"] = {
      str(j + 1): _bucket_rates(position_n, dropped_lnk[:, :, j].mean(0), edges)
      for j in range(dropped_lnk.shape[-1])}
  return result


def _modal_experts(record: RoutingRecord, layer: int, token_ids: np.ndarray
                   ) -> np.ndarray:
  """Returns each token id's most common top-1 expert in `layer` ([T])."""
  ids, counts_ge = _group_counts(record.token, record.expert[layer, :, 0],
                                 record.num_experts)
  return counts_ge[np.searchsorted(ids, token_ids)].argmax(-1)


def routing_stability(records: Sequence[RoutingRecord], min_count: int = 5) -> Dict:
  """Returns how often frequent tokens keep their most common top-1 expert across
  checkpoints (records ordered by step, over the same data).

  Frequent tokens: ids with >= `min_count` occurrences in every record. Keys:
  `steps`, `num_tokens`, `to_final` {layer: [overlap of each step with the last]},
  `consecutive` {layer: [overlap of step i with step i-1], None for the first},
  `mean_to_final`, `mean_consecutive` (over layers) and `chance` = 1/E (expected
  overlap of independent uniform assignments).
  """
  if not records:
    raise ValueError("routing_stability needs at least one record")
  common = None
  for rec in records:
    ids, counts = np.unique(rec.token, return_counts=True)
    frequent = set(ids[counts >= min_count].tolist())
    common = frequent if common is None else common & frequent
  token_ids = np.array(sorted(common), dtype=np.int64)
  layers = [str(x) for x in records[-1].moe_layers]
  to_final, consecutive = {}, {}
  for l, name in enumerate(layers):
    modes = [_modal_experts(rec, l, token_ids) for rec in records]
    overlap = lambda a, b: float(np.mean(a == b)) if token_ids.size else None
    to_final[name] = [overlap(m, modes[-1]) for m in modes]
    consecutive[name] = [None] + [overlap(modes[i], modes[i - 1])
                                  for i in range(1, len(modes))]
  mean = lambda curves, i: (None if curves[layers[0]][i] is None
                            else float(np.mean([curves[n][i] for n in layers])))
  return {"steps": [rec.step for rec in records], "num_tokens": int(token_ids.size),
          "min_count": min_count, "to_final": to_final, "consecutive": consecutive,
          "mean_to_final": [mean(to_final, i) for i in range(len(records))],
          "mean_consecutive": [mean(consecutive, i) for i in range(len(records))],
          "chance": 1.0 / records[-1].num_experts}


def domain_load(record: RoutingRecord) -> Dict:
  """Returns per-task expert load: share of all top-k choices (before capacity) that
  go to each expert, `load` [task][layer][E]; and `total_variation` {"a vs b":
  [per layer]} between every pair of tasks (0: same load, 1: disjoint experts)."""
  num_experts = record.num_experts
  load = []
  for t in range(len(record.task_names)):
    sel = record.task == t
    per_layer = []
    for l in range(record.num_layers):
      counts = np.bincount(record.expert[l, sel].ravel().astype(np.int64),
                           minlength=num_experts)
      per_layer.append((counts / max(counts.sum(), 1)).tolist())
    load.append(per_layer)
  load_tle = np.array(load)
  names = record.task_names
  tv = {f"{names[a]} vs {names[b]}":
        (0.5 * np.abs(load_tle[a] - load_tle[b]).sum(-1)).tolist()
        for a in range(len(names)) for b in range(a + 1, len(names))}
  return {"tasks": list(names), "layers": list(record.moe_layers), "load": load,
          "total_variation": tv}
