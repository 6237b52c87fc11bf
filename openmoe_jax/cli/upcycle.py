"""`openmoe-upcycle`: turn a trained dense checkpoint into a step-0 MoE checkpoint
(upcycle.py).

  openmoe-upcycle --dense_checkpoint=/tmp/dense --output=/tmp/moe \\
      --gin_file=runs/ablate_tiny.gin --gin_file=experiments/openmoe2/upcycled.gin
"""
import sys

from openmoe_jax.cli import flags
from openmoe_jax.upcycle import upcycle

PROGRAM = flags.Program(
    "openmoe-upcycle",
    "Sparse upcycling: turn a trained dense checkpoint into a step-0 MoE checkpoint "
    "(each dense FFN becomes the experts of the MoE layer at the same depth; fresh "
    "routers and optimizer state). The gin files describe the MoE run exactly as "
    "openmoe-train is given them.",
    ["openmoe-upcycle --dense_checkpoint=/tmp/dense --output=/tmp/moe "
     "--gin_file=runs/ablate_tiny.gin --gin_file=experiments/openmoe2/upcycled.gin"],
    gin=True)
PROGRAM.add("--dense_checkpoint", required=True, metavar="DIR",
            help="MODEL_DIR of the trained dense run")
PROGRAM.add("--output", required=True, metavar="DIR",
            help="MODEL_DIR to create for the MoE run")
PROGRAM.add("--step", type=flags.int_at_least(0), default=None,
            help="dense step (default: the newest)")
PROGRAM.add("--seed", type=int, default=0, help="seed of the fresh routers")


def _run(args, gin_flags: flags.GinFlags) -> int:
  if not gin_flags.files:
    raise flags.UsageError("--gin_file is required: the MoE run's gin files")
  upcycle(args.dense_checkpoint, args.output, gin_flags.files, gin_flags.bindings,
          step=args.step, seed=args.seed)
  return 0


def main(argv=None) -> int:
  """CLI entry point; returns the exit code (0, or 2 on bad input)."""
  return PROGRAM.main(_run, argv)


if __name__ == "__main__":
  sys.exit(main())
