"""`openmoe-analyze`: record a trained run's routing and write the routing report.

  openmoe-analyze --model_dir=/tmp/openmoe_quickstart --output=/tmp/analysis \
      [--checkpoints=all|STEP,...] [--tasks=local_code,local_text] [--num_batches=16] \
      [--priority=choice_major|position_major]

Writes `report.md` (plots linked), `report.json` (every number), the PNGs and
`records/step_<n>.npz` (rerun the analyses without the model: `--from_records=DIR`).
"""
import argparse
import sys
import time
from typing import List, Optional, Sequence

from openmoe_jax.analysis.study import analyze_records, load_records, record_checkpoints
from openmoe_jax.cli import flags
from openmoe_jax.data import pipeline
from openmoe_jax.moe.routers import PRIORITIES
from openmoe_jax.run_loader import check_task, load_run


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
PROGRAM.add("--num_batches", type=flags.int_at_least(1), default=16, help="batches per task")
PROGRAM.add("--batch_size", type=flags.int_at_least(1), default=None, help="default: the run's")
PROGRAM.add("--sequence_length", type=flags.int_at_least(1), default=None, help="default: the run's")
PROGRAM.add("--pack", type=_bool, default=True,
            help="pack documents into rows as in training (default true)")
PROGRAM.add("--split", default="validation")
PROGRAM.add("--num_buckets", type=flags.int_at_least(1), default=8, help="position buckets for drops")
PROGRAM.add("--min_count", type=flags.int_at_least(1), default=5,
            help="a token id counts as frequent from this many occurrences")
PROGRAM.add("--from_records", default=None,
            help="reuse records/step_*.npz from this folder instead of the model")
PROGRAM.add("--priority", default=None, choices=PRIORITIES,
            help="route the checkpoints with this token-choice priority instead "
                 "of the run's (compare drop-by-position of the two orders on "
                 "the same weights)")


def _select_steps(available: List[int], spec: str) -> List[int]:
  if spec == "all":
    return list(available)
  if spec == "latest":
    return [available[-1]]
  try:
    wanted = sorted({int(s) for s in spec.split(",") if s.strip()})
  except ValueError:
    wanted = []
  if not wanted:
    raise flags.UsageError(f"--checkpoints={spec!r}: give 'all', 'latest' or "
                           f"comma-separated steps from {available}")
  missing = [s for s in wanted if s not in available]
  if missing:
    raise flags.UsageError(f"--checkpoints: no checkpoint at step(s) {missing}; "
                           f"available: {available}")
  return wanted


def main(argv: Optional[Sequence[str]] = None) -> int:
  """CLI entry point; returns the exit status (0, or 2 on bad input)."""
  return PROGRAM.main(lambda args, _: _run(args), argv)


def _run(args: argparse.Namespace) -> int:
  if not args.model_dir and not args.from_records:
    raise flags.UsageError("give --model_dir (or --from_records)")
  t0 = time.perf_counter()
  say = lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)
  if args.from_records:
    records, meta = load_records(args.from_records, args.model_dir)
    if args.model_dir:  # the run's vocabulary settings, for decoding token ids
      load_run(args.model_dir, vocab_task=records[-1].task_names[0])
  else:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
      raise flags.UsageError("--tasks is empty: name at least one seqio task")
    for task in tasks:
      check_task(task, "--tasks")
    run = load_run(args.model_dir, vocab_task=tasks[0])
    records, meta = record_checkpoints(
        run, _select_steps(run.steps, args.checkpoints), tasks, args.output,
        num_batches=args.num_batches, batch_size=args.batch_size,
        sequence_length=args.sequence_length, pack=args.pack, split=args.split,
        priority=args.priority, say=say)
  vocab = pipeline.vocabulary_for(meta["tasks"][0])
  analyze_records(records, args.output, meta, decode=lambda i: vocab.decode([i]),
                  num_buckets=args.num_buckets, min_count=args.min_count, say=say)
  return 0


if __name__ == "__main__":
  sys.exit(main())
