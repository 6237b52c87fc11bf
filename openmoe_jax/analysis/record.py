"""Routing records: every real token's routing in every MoE layer, saved as npz.

A record is what the analyses read; it never needs the model again. Per token n:
`token` (input token id: the id the router sees), `position` (index in the row,
which sets capacity priority within a group), `doc_position` (position inside its
document, `decoder_positions`), `task` (index into `task_names`), `row` (batch row,
numbered across all batches). Per MoE layer l and choice j < k: `expert` [L, N, k],
`gate` [L, N, k] (router probability, 0 where dropped) and `kept` [L, N, k].
Padding (segment id 0) is routed by the model but not recorded.
"""
import dataclasses
import json
from typing import Callable, Dict, Iterable, List, Optional

import flax.linen as nn
import jax
import numpy as np

from openmoe_jax.analysis.routing import flatten_routing
from openmoe_jax.config import ModelConfig
from openmoe_jax.model import Decoder

_TOKEN_FIELDS = ("token", "position", "doc_position", "task", "row")
_LAYER_FIELDS = ("expert", "gate", "kept")


@dataclasses.dataclass
class RoutingRecord:
  """Per-token routing of one checkpoint over evaluation data (numpy arrays)."""

  token: np.ndarray  # [N] int32
  position: np.ndarray  # [N] int32
  doc_position: np.ndarray  # [N] int32
  task: np.ndarray  # [N] int16
  row: np.ndarray  # [N] int32
  expert: np.ndarray  # [L, N, k] int16
  gate: np.ndarray  # [L, N, k] float16
  kept: np.ndarray  # [L, N, k] bool
  task_names: List[str]
  num_experts: int
  sequence_length: int
  moe_layers: List[int]  # model layer number of each recorded MoE layer
  step: Optional[int] = None

  @property
  def num_layers(self) -> int:
    """Returns the number of recorded MoE layers."""
    return self.expert.shape[0]

  def save(self, path: str) -> str:
    """Writes the record as a compressed npz; returns `path`."""
    meta = {"task_names": self.task_names, "num_experts": self.num_experts,
            "sequence_length": self.sequence_length, "moe_layers": self.moe_layers,
            "step": self.step}
    arrays = {f: getattr(self, f) for f in _TOKEN_FIELDS + _LAYER_FIELDS}
    with open(path, "wb") as f:
      np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)
    return path

  @classmethod
  def load(cls, path: str) -> "RoutingRecord":
    """Returns the record saved at `path` by `save`."""
    with np.load(path) as data:
      meta = json.loads(str(data["meta"]))
      arrays = {f: data[f] for f in _TOKEN_FIELDS + _LAYER_FIELDS}
    return cls(**arrays, **meta)


def make_routing_fn(cfg: ModelConfig, train: bool = True) -> Callable:
  """Returns jitted fn(params, batch) -> ({expert_index, gates, kept} [L, b, t, k],
  model aux). `train=True` uses the training capacity factor, as during training."""
  model = Decoder(cfg)

  def routing_fn(params, batch):
    (_, aux), state = model.apply(
        {"params": params}, batch["decoder_input_tokens"],
        positions_bt=batch["decoder_positions"],
        segment_ids_bt=batch["decoder_segment_ids"], attention_kind="causal",
        train=train, mutable=["intermediates"])
    return flatten_routing(state.get("intermediates", {}), cfg), aux
  return jax.jit(routing_fn)


def _pad_rows(batch: Dict[str, np.ndarray], batch_size: int) -> Dict[str, np.ndarray]:
  """Returns `batch` padded with all-padding rows up to `batch_size` rows."""
  missing = batch_size - batch["decoder_input_tokens"].shape[0]
  if missing <= 0:
    return batch
  return {k: np.concatenate([v, np.zeros((missing,) + v.shape[1:], v.dtype)])
          for k, v in batch.items()}


def _check_token_choice(expert_lbtk: np.ndarray, num_experts: int) -> None:
  """Raises ValueError for expert-choice routing (slot j is always expert j), which
  has no per-token ranked choices for these analyses to read."""
  k = expert_lbtk.shape[-1]
  if k == num_experts and np.all(expert_lbtk == np.arange(k)):
    raise ValueError("routing analysis reads token-choice routing (ranked choices per "
                     "token); this model routes by expert choice")


def record_routing(cfg: ModelConfig, params, batches_by_task: Dict[str, Iterable],
                   batch_size: int, step: Optional[int] = None,
                   routing_fn: Optional[Callable] = None,
                   progress: Callable[[str], None] = lambda _: None) -> RoutingRecord:
  """Runs the model over each task's batches; returns the RoutingRecord of every
  real token (segment id != 0) with the training-time capacity."""
  routing_fn = routing_fn or make_routing_fn(cfg)
  params = nn.unbox(params)
  parts: Dict[str, List[np.ndarray]] = {f: [] for f in _TOKEN_FIELDS + _LAYER_FIELDS}
  rows_seen, seq_len = 0, 0
  for task_index, (task, batches) in enumerate(batches_by_task.items()):
    count = 0
    for batch in batches:
      batch = _pad_rows(batch, batch_size)
      routing, _ = jax.device_get(routing_fn(params, batch))
      _check_token_choice(routing["expert_index"], cfg.moe.num_experts)
      real_bt = batch["decoder_segment_ids"] != 0
      b, t = real_bt.shape
      fields = {
          "token": batch["decoder_input_tokens"],
          "position": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)),
          "doc_position": batch["decoder_positions"],
          "task": np.full((b, t), task_index, np.int16),
          "row": np.broadcast_to(rows_seen + np.arange(b, dtype=np.int32)[:, None], (b, t)),
      }
      for f, v in fields.items():
        parts[f].append(np.asarray(v)[real_bt])
      for f, key in zip(_LAYER_FIELDS, ("expert_index", "gates", "kept")):
        parts[f].append(np.asarray(routing[key])[:, real_bt])
      rows_seen, seq_len = rows_seen + b, t
      count += 1
    if not count:
      raise ValueError(f"task {task!r} gave no batches: is its split empty?")
    progress(f"  {task}: {count} batches")
  return RoutingRecord(
      token=np.concatenate(parts["token"]).astype(np.int32),
      position=np.concatenate(parts["position"]).astype(np.int32),
      doc_position=np.concatenate(parts["doc_position"]).astype(np.int32),
      task=np.concatenate(parts["task"]).astype(np.int16),
      row=np.concatenate(parts["row"]).astype(np.int32),
      expert=np.concatenate(parts["expert"], axis=1).astype(np.int16),
      gate=np.concatenate(parts["gate"], axis=1).astype(np.float16),
      kept=np.concatenate(parts["kept"], axis=1).astype(bool),
      task_names=list(batches_by_task), num_experts=cfg.moe.num_experts,
      sequence_length=int(seq_len), moe_layers=cfg.moe_layer_numbers(),
      step=step)
