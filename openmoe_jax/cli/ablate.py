"""`openmoe-ablate`: train OpenMoE 2 ablation arms side by side and print one table
row (or JSON object) per arm (ablate.py).

  openmoe-ablate [--arms=tc_softmax,ec_batch,...] [--steps=100] [--output=DIR]
                 [--run_gin=runs/ablate_tiny.gin] [--gin.NAME=VALUE ...] [--json]
"""
import dataclasses
import json
import sys

from openmoe_jax import gin_utils
from openmoe_jax.ablate import (available_arms, format_table, run_arms,
                                short_run_bindings)
from openmoe_jax.cli import flags

PROGRAM = flags.Program(
    "openmoe-ablate",
    "Train OpenMoE 2 ablation arms (gin files under gin/experiments/openmoe2/) with "
    "the same run file, steps and seed, one MODEL_DIR each under --output, and print "
    "one table row per arm: validation loss at the start and the end, drop fraction, "
    "expert-load CV and tokens/s. The `upcycled` arm is upcycled from the `dense` "
    "arm's final checkpoint (trained first if not asked for).",
    ["openmoe-ablate --steps=100",
     "openmoe-ablate --arms=tc_softmax,ec_batch --steps=10 --output=/tmp/abl",
     "openmoe-ablate --list"],
    gin=True,
    details="The arms pick the models: give training settings with --run_gin and "
    "overrides with --gin.NAME=VALUE\n(no --gin_file). A warmup as long as --steps is "
    "shortened to steps // 10 (said in the output).")
PROGRAM.add("--arms", default=None, metavar="A,B,...",
            help="comma-separated arms (default: all; see --list)")
PROGRAM.add("--steps", type=int, default=100, help="training steps per arm")
PROGRAM.add("--output", default="/tmp/openmoe_ablate", metavar="DIR",
            help="one MODEL_DIR per arm is created under it")
PROGRAM.add("--run_gin", default="runs/ablate_tiny.gin", metavar="FILE",
            help="run file with the training settings shared by the arms")
PROGRAM.add("--json", action="store_true",
            help="print one JSON object per arm (progress goes to stderr)")
PROGRAM.add("--list", action="store_true", help="list the arms and exit")


def _run(args, gin_flags: flags.GinFlags) -> int:
  if gin_flags.files:
    raise flags.UsageError("openmoe-ablate takes no --gin_file: the arms pick the "
                           "models; use --run_gin and --gin.NAME=VALUE")
  gin_utils.import_configurables()
  if args.list:
    print("\n".join(available_arms()))
    return 0
  arms = args.arms.split(",") if args.arms else available_arms()
  log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
  emit = (lambda r: print(json.dumps(dataclasses.asdict(r)), flush=True)) if args.json \
      else (lambda r: None)
  bindings, note = short_run_bindings(args.run_gin, args.steps, gin_flags.bindings)
  if note:
    log(note)
  results = run_arms(arms, args.steps, args.output, args.run_gin, bindings, log, emit)
  if not args.json:
    print("\n" + format_table(results))
  return 0


def main(argv=None) -> int:
  """CLI entry point; returns the exit code (0, or 2 on bad input)."""
  return PROGRAM.main(_run, argv)


if __name__ == "__main__":
  sys.exit(main())
