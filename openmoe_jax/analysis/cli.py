"""`openmoe-analyze`: record a trained run's routing and write the routing report.

  openmoe-analyze --model_dir=/tmp/openmoe_quickstart --output=/tmp/analysis \
      [--checkpoints=all|STEP,...] [--tasks=local_code,local_text] [--num_batches=16] \
      [--priority=choice_major|position_major]

Writes `report.md` (plots linked), `report.json` (every number), the PNGs and
`records/step_<n>.npz` (rerun the analyses without the model: `--from_records=DIR`).
"""
import argparse
import dataclasses
import glob
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from openmoe_jax.analysis import analyses, plots
from openmoe_jax.analysis.record import RoutingRecord, make_routing_fn, record_routing
from openmoe_jax.analysis.report import write_report
from openmoe_jax.cli import flags
from openmoe_jax.moe.layer import router_of
from openmoe_jax.moe.routers import PRIORITIES


def _bool(text: str) -> bool:
  if text.lower() in ("1", "true", "yes"):
    return True
  if text.lower() in ("0", "false", "no"):
    return False
  raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


PROGRAM = flags.Program(
    "openmoe-analyze",
    "Record a trained run's routing on evaluation data and write the routing report "
    "(the OpenMoE paper's findings: token-ID specialization, drop towards the end, "
    "early routing learning, domain load): report.md with plots, report.json with "
    "every number, and records/step_<n>.npz to rerun the analyses without the model "
    "(--from_records). Layers are named by their model layer number (0-based), as "
    "in the training metrics.",
    ["openmoe-analyze --model_dir=/tmp/openmoe_quickstart --output=/tmp/analysis",
     "openmoe-analyze --from_records=/tmp/analysis/records --output=/tmp/again"])
PROGRAM.add("--model_dir", help="training MODEL_DIR (config.gin + checkpoints/)")
PROGRAM.add("--output", required=True, help="folder for the report")
PROGRAM.add("--checkpoints", default="all",
            help="'all', 'latest' or comma-separated steps; the last one is analysed "
                 "in full, all of them feed the early-routing curve")
PROGRAM.add("--tasks", default="local_code,local_text",
            help="comma-separated seqio tasks (validation split)")
PROGRAM.add("--num_batches", type=int, default=16, help="batches per task")
PROGRAM.add("--batch_size", type=int, default=None, help="default: the run's")
PROGRAM.add("--sequence_length", type=int, default=None, help="default: the run's")
PROGRAM.add("--pack", type=_bool, default=True,
            help="pack documents into rows as in training (default true)")
PROGRAM.add("--split", default="validation")
PROGRAM.add("--num_buckets", type=int, default=8, help="position buckets for drops")
PROGRAM.add("--min_count", type=int, default=5,
            help="a token id counts as frequent from this many occurrences")
PROGRAM.add("--from_records", default=None,
            help="reuse records/step_*.npz from this folder instead of the model")
PROGRAM.add("--priority", default=None, choices=PRIORITIES,
            help="route the checkpoints with this token-choice priority instead "
                 "of the run's (compare drop-by-position of the two orders on "
                 "the same weights)")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """Returns the parsed command line; raises flags.UsageError on bad input."""
  args, _ = PROGRAM.parse(list(argv))
  if not args.model_dir and not args.from_records:
    raise flags.UsageError("give --model_dir (or --from_records)")
  return args


def _select_steps(available: List[int], spec: str) -> List[int]:
  if spec == "all":
    return list(available)
  if spec == "latest":
    return [available[-1]]
  wanted = sorted({int(s) for s in spec.split(",") if s.strip()})
  missing = [s for s in wanted if s not in available]
  if missing:
    raise flags.UsageError(f"checkpoints {missing} not found; available: {available}")
  return wanted


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


def record_checkpoints(args, say: Callable[[str], None]):
  """Returns (records ordered by step, meta dict) for the chosen checkpoints."""
  from openmoe_jax.run_loader import load_run, restore_params  # heavy imports
  from openmoe_jax.data import pipeline
  tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
  run = load_run(args.model_dir, vocab_task=tasks[0])
  seq_len = args.sequence_length or run.sequence_length
  batch_size = args.batch_size or run.batch_size
  steps = _select_steps(run.steps, args.checkpoints)
  say(f"model: {run.config.num_layers} layers, {run.config.moe.num_experts} experts; "
      f"checkpoints {steps}; tasks {tasks}; {args.num_batches} x {batch_size} x {seq_len}")
  config = with_priority(run.config, args.priority)
  priority = getattr(router_of(config.moe), "priority", None)
  if priority:
    say(f"token-choice priority: {priority}")
  routing_fn = make_routing_fn(config, train=True)
  os.makedirs(os.path.join(args.output, "records"), exist_ok=True)
  records = []
  for step in steps:
    start = time.perf_counter()
    params = restore_params(args.model_dir, step)
    batches = {task: pipeline.get_dataset(
        task, seq_len, batch_size, split=args.split, shuffle=False, repeat=False,
        pack=args.pack, num_batches=args.num_batches) for task in tasks}
    rec = record_routing(config, params, batches, batch_size, step=step,
                         routing_fn=routing_fn, progress=say)
    rec.save(os.path.join(args.output, "records", f"step_{step}.npz"))
    say(f"recorded step {step}: {rec.token.size} tokens, {rec.num_layers} MoE layers "
        f"({time.perf_counter() - start:.1f}s)")
    records.append(rec)
  meta = {"model_dir": os.path.abspath(args.model_dir), "tasks": tasks,
          "num_batches": args.num_batches, "batch_size": batch_size,
          "sequence_length": seq_len, "pack": args.pack,
          "capacity_factor": config.moe.capacity_factor(True), "priority": priority}
  with open(os.path.join(args.output, "records", "meta.json"), "w") as f:
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
  say(f"token-ID specialization: token id {results['specialization']['token_score']:.3f}"
      f", position {results['specialization']['position_score']:.3f}")
  results["drops"] = analyses.drop_by_position(final, num_buckets=num_buckets)
  say("drop rate, first -> last position bucket: " + "; ".join(
      f"{t} {r[0]:.3f} -> {r[-1]:.3f}" for t, r in results["drops"]["by_task"].items()
      if r[0] is not None and r[-1] is not None))
  results["stability"] = analyses.routing_stability(records, min_count=min_count)
  say("top-expert overlap with the final checkpoint: " + ", ".join(
      f"step {s}: {v:.3f}" for s, v in zip(results["stability"]["steps"],
                                           results["stability"]["mean_to_final"])))
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


def main(argv: Optional[Sequence[str]] = None) -> int:
  """CLI entry point; returns the exit status (0, or 2 on bad input)."""
  return PROGRAM.main(lambda args, _: _run(args), argv)


def _run(args: argparse.Namespace) -> int:
  if not args.model_dir and not args.from_records:
    raise flags.UsageError("give --model_dir (or --from_records)")
  t0 = time.perf_counter()
  say = lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)
  if args.from_records:
    paths = sorted(glob.glob(os.path.join(args.from_records, "step_*.npz")),
                   key=lambda p: int(os.path.basename(p)[5:-4]))
    if not paths:
      raise FileNotFoundError(f"no step_*.npz in {args.from_records}")
    records = [RoutingRecord.load(p) for p in paths]
    if args.model_dir:  # the run's vocabulary settings, for decoding token ids
      from openmoe_jax.run_loader import load_run  # pylint: disable=g-import-not-at-top
      load_run(args.model_dir, vocab_task=records[-1].task_names[0])
    meta_path = os.path.join(args.from_records, "meta.json")
    meta = {"model_dir": args.model_dir, "tasks": records[-1].task_names,
            "num_batches": None, "batch_size": None,
            "sequence_length": records[-1].sequence_length, "pack": None,
            "capacity_factor": None, "priority": None}
    if os.path.exists(meta_path):
      with open(meta_path) as f:
        meta.update(json.load(f))
  else:
    records, meta = record_checkpoints(args, say)
  from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  vocab = pipeline.vocabulary_for(meta["tasks"][0])
  analyze_records(records, args.output, meta, decode=lambda i: vocab.decode([i]),
                  num_buckets=args.num_buckets, min_count=args.min_count, say=say)
  return 0


if __name__ == "__main__":
  sys.exit(main())
