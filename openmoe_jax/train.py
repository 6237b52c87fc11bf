"""Command line: `openmoe-train --gin_file=runs/quickstart.gin` (or `python -m
openmoe_jax.train`).

t5x conventions: `--gin_file=` (repeatable, found on a search path that includes the
installed gin/ folder), `--gin.NAME=VALUE` overrides (macros MODEL_DIR, TRAIN_STEPS,
BATCH_SIZE, SEQUENCE_LENGTH, MIXTURE_OR_TASK_NAME), `--gin_search_paths=a,b`.
The loop itself is in trainer.py, so running this file as __main__ registers no
configurable twice.
"""
import sys
from typing import Any, Dict

from openmoe_jax import gin_utils
from openmoe_jax.trainer import train


def print_run_summary(summary: Dict[str, Any]) -> None:
  """Prints the end-of-run summary (first/last validation loss, tokens/s)."""
  print("\n=== openmoe_jax run summary ===")
  for key in ("first_eval_loss", "last_eval_loss", "last_train_loss",
              "tokens_per_sec", "final_step"):
    if key in summary:
      value = summary[key]
      print(f"{key:>16}: {value:.4f}" if isinstance(value, float) else
            f"{key:>16}: {value}")


def main(argv=None) -> int:
  """CLI entry point: parses gin flags, checks required bindings, trains."""
  argv = list(sys.argv[1:] if argv is None else argv)
  other = gin_utils.configure_from_argv(argv)
  if other:
    raise SystemExit(f"unknown arguments: {' '.join(other)} (use --gin_file= and "
                     "--gin.NAME=VALUE)")
  gin_utils.check_required(train)
  summary = train()
  print_run_summary(summary)
  return 0


if __name__ == "__main__":
  sys.exit(main())
