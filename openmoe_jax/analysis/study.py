"""A routing study of a trained run, as `openmoe-analyze` (cli/analyze.py) runs it:
record the routing of its checkpoints (`record_checkpoints`), then run every
analysis on the records and write the plots and the report (`analyze_records`).
"""
import dataclasses
import glob
import json
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from openmoe_jax.analysis import analyses, plots
from openmoe_jax.analysis.record import RoutingRecord, make_routing_fn, record_routing
from openmoe_jax.analysis.report import format_number, write_report
from openmoe_jax.data import pipeline
from openmoe_jax.moe.layer import router_of
from openmoe_jax.run_loader import Run, restore_params


def with_priority(cfg, priority: Optional[str]):
  """Returns `cfg` with its token-choice router's priority set to `priority`
  (unchanged for None); ValueError for an expert-choice model."""
  router = router_of(cfg.moe)
  if priority is None:
    return cfg
  if not hasattr(router, "priority"):
    raise ValueError(f"--priority needs token-choice routing; the run uses "
                     f"{type(router).__name__}")
  router = dataclasses.replace(router, priority=priority)
  return cfg.replace(moe=cfg.moe.replace(router=router))


def record_checkpoints(run: Run, steps: Sequence[int], tasks: Sequence[str],
                       output: str, *, num_batches: int = 16,
                       batch_size: Optional[int] = None,
                       sequence_length: Optional[int] = None, pack: bool = True,
                       split: str = "validation", priority: Optional[str] = None,
                       say: Callable[[str], None] = print):
  """Records the routing of `run` at `steps` on `tasks` (batch size and sequence
  length default to the run's), saving output/records/step_<n>.npz and meta.json;
  returns (records ordered by step, meta dict)."""
  tasks = list(tasks)
  seq_len = sequence_length or run.sequence_length
  batch_size = batch_size or run.batch_size
  say(f"model: {run.config.num_layers} layers, {run.config.moe.num_experts} experts; "
      f"checkpoints {steps}; tasks {tasks}; {num_batches} x {batch_size} x {seq_len}")
  config = with_priority(run.config, priority)
  priority = getattr(router_of(config.moe), "priority", None)
  if priority:
    say(f"token-choice priority: {priority}")
  routing_fn = make_routing_fn(config, train=True)
  os.makedirs(os.path.join(output, "records"), exist_ok=True)
  records = []
  for step in steps:
    start = time.perf_counter()
    params = restore_params(run.model_dir, step)
    batches = {task: pipeline.get_dataset(
        task, seq_len, batch_size, split=split, shuffle=False, repeat=False,
        pack=pack, num_batches=num_batches) for task in tasks}
    rec = record_routing(config, params, batches, batch_size, step=step,
                         routing_fn=routing_fn, progress=say)
    rec.save(os.path.join(output, "records", f"step_{step}.npz"))
    say(f"recorded step {step}: {rec.token.size} tokens, {rec.num_layers} MoE layers "
        f"({time.perf_counter() - start:.1f}s)")
    records.append(rec)
  meta = {"model_dir": os.path.abspath(run.model_dir), "tasks": tasks,
          "num_batches": num_batches, "batch_size": batch_size,
          "sequence_length": seq_len, "pack": pack,
          "capacity_factor": config.moe.capacity_factor(True), "priority": priority}
  with open(os.path.join(output, "records", "meta.json"), "w") as f:
    json.dump(meta, f)
  return records, meta


def analyze_records(records: List[RoutingRecord], output: str, meta: Dict,
                    decode: Optional[Callable[[int], str]] = None,
                    num_buckets: int = 8, min_count: int = 5,
                    say: Callable[[str], None] = print) -> Dict:
  """Runs every analysis on `records` (the last one in full, all for stability),
  writes the plots and the report into `output`; returns the results dict."""
  final = records[-1]
  rows = {name: int(np.unique(final.row[final.task == t]).size)
          for t, name in enumerate(final.task_names)}
  meta = dict(meta, step=final.step, num_tokens=int(final.token.size),
              checkpoints=[r.step for r in records], rows_per_task=rows)
  results: Dict = {"meta": meta}
  results["specialization"] = analyses.token_specialization(
      final, min_count=min_count, decode=decode)
  say("token-ID specialization: token id "
      f"{format_number(results['specialization']['token_score'])}, position "
      f"{format_number(results['specialization']['position_score'])}")
  results["drops"] = analyses.drop_by_position(final, num_buckets=num_buckets)
  say("drop rate, first -> last position bucket: " + "; ".join(
      f"{t} {r[0]:.3f} -> {r[-1]:.3f}" for t, r in results["drops"]["by_task"].items()
      if r[0] is not None and r[-1] is not None))
  stability = results["stability"] = analyses.routing_stability(
      records, min_count=min_count)
  say("top-expert overlap with the final checkpoint: " + ", ".join(
      f"step {s}: {format_number(v)}"
      for s, v in zip(stability["steps"], stability["mean_to_final"])))
  results["domain_load"] = analyses.domain_load(final)
  os.makedirs(output, exist_ok=True)
  out = lambda name: os.path.join(output, name)
  plots.plot_specialization_scores(results["specialization"], out("specialization_scores.png"))
  plots.plot_token_expert_distribution(results["specialization"],
                                       out("token_expert_distribution.png"))
  plots.plot_drop_by_position(results["drops"], out("drop_by_position.png"))
  plots.plot_routing_stability(results["stability"], out("routing_stability.png"))
  plots.plot_domain_load(results["domain_load"], out("domain_load.png"))
  paths = write_report(output, results)
  say(f"wrote {paths['markdown']} and {paths['json']}")
  return results


def load_records(folder: str, model_dir: Optional[str] = None):
  """Returns (records ordered by step, meta dict) read from the step_*.npz and
  meta.json that `record_checkpoints` saved in `folder` (meta.json missing: what the
  records tell, `model_dir` and None for the rest)."""
  paths = sorted(glob.glob(os.path.join(folder, "step_*.npz")),
                 key=lambda p: int(os.path.basename(p)[5:-4]))
  if not paths:
    raise FileNotFoundError(f"no step_*.npz in {folder}")
  records = [RoutingRecord.load(p) for p in paths]
  meta_path = os.path.join(folder, "meta.json")
  meta = {"model_dir": model_dir, "tasks": records[-1].task_names,
          "num_batches": None, "batch_size": None,
          "sequence_length": records[-1].sequence_length, "pack": None,
          "capacity_factor": None, "priority": None}
  if os.path.exists(meta_path):
    with open(meta_path) as f:
      meta.update(json.load(f))
  return records, meta
