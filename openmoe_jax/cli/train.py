"""Command line: `openmoe-train --gin_file=runs/quickstart.gin` (or `python -m
openmoe_jax.cli.train`).

t5x conventions: `--gin_file=` (repeatable, found on a search path that includes the
installed gin/ folder), `--gin.NAME=VALUE` overrides (macros MODEL_DIR, TRAIN_STEPS,
BATCH_SIZE, SEQUENCE_LENGTH, MIXTURE_OR_TASK_NAME), `--gin_search_paths=a,b`.
The loop itself is in trainer.py, so running this file as __main__ registers no
configurable twice.

Exit codes: 0 trained to TRAIN_STEPS, or stopped by SIGTERM after a checkpoint
(preemption: relaunch the same command); 130 stopped by Ctrl-C after a checkpoint
(the same command resumes); 2 bad flags or gin configuration. A second Ctrl-C kills
the process at once (no checkpoint of the steps since the last one).
"""
import math
import sys
from typing import Any, Dict

from openmoe_jax import gin_utils, run_loader
from openmoe_jax.cli import flags
from openmoe_jax.config import ModelConfig
from openmoe_jax.trainer import train

# Summary keys in print order; the losses are named as in metrics.jsonl:
# `ce_loss` the cross-entropy, `loss` the cross-entropy plus the auxiliary losses.
SUMMARY_KEYS = ("first_eval_ce_loss", "last_eval_ce_loss", "last_train_loss",
                "last_train_ce_loss", "tokens_per_sec", "mfu", "tokens_per_sec_median",
                "mfu_median", "mfu_peak_gflops", "final_step")

PROGRAM = flags.Program(
    "openmoe-train",
    "Train (or resume) a Mixture-of-Experts decoder configured by gin files. "
    "MODEL_DIR receives checkpoints, metrics.jsonl, TensorBoard events and the "
    "operative config.gin; relaunching the same command resumes from the newest "
    "checkpoint.",
    ["openmoe-train --gin_file=runs/quickstart.gin",
     "openmoe-train --gin_file=runs/quickstart.gin --gin.MODEL_DIR=/tmp/q "
     "--gin.TRAIN_STEPS=30"],
    gin=True,
    details="Ctrl-C or SIGTERM: the step in flight finishes, a checkpoint is "
    "written, and the program exits\n(130 after Ctrl-C, 0 after SIGTERM); press "
    "Ctrl-C twice to abort at once without one.\nExit codes: 0 done, 2 bad flags "
    "or configuration, 130 interrupted (resumable).")


def print_run_summary(summary: Dict[str, Any]) -> None:
  """Prints the end-of-run summary (validation and training losses, tokens/s, MFU)."""
  print("\n=== openmoe_jax run summary ===")
  for key in SUMMARY_KEYS:
    if key not in summary:
      continue
    value = summary[key]
    if value is None or (isinstance(value, float) and math.isnan(value)):
      value = "n/a (no training step ran)" if key == "tokens_per_sec" else "n/a"
    print(f"{key:>21}: {value:.4f}" if isinstance(value, float) else
          f"{key:>21}: {value}")


def _run(args, gin_flags: flags.GinFlags) -> int:
  del args
  gin_utils.import_configurables()
  gin_utils.parse_gin(gin_flags.files, gin_flags.bindings, gin_flags.search_paths)
  gin_utils.check_required(train)
  if not run_loader.query("train.stages"):
    run_loader.check_task(run_loader.query("train.mixture_or_task_name"),
                          "train.mixture_or_task_name (MIXTURE_OR_TASK_NAME)")
  _check_moe_groups()
  summary = train()
  print_run_summary(summary)
  if summary.get("interrupted"):
    return flags.EXIT_INTERRUPTED
  return flags.EXIT_OK


def _check_moe_groups() -> None:
  """Raises UsageError when MoeConfig.group_size does not divide the tokens of a
  training (micro)batch: the MoE layer would only find out while tracing the first
  step, after the run has written to MODEL_DIR. Returns None."""
  cfg = run_loader.query("train.model_config") or ModelConfig()
  batch_size = run_loader.query("train.batch_size")
  sequence_length = run_loader.query("train.sequence_length")
  microbatches = run_loader.query("train.microbatches", 1)
  if not any(cfg.sparse_layers()) or batch_size % microbatches:
    return  # no MoE layer; or train() names the batch/microbatch mismatch
  tokens = batch_size // microbatches * sequence_length
  if tokens % min(cfg.moe.group_size, tokens):
    divisors = [d for d in (sequence_length, 4096, 2048, 1024, 512, 256, 128, 64)
                if d <= tokens and tokens % d == 0]
    raise flags.UsageError(
        f"MoeConfig.group_size={cfg.moe.group_size} must divide the {tokens} tokens of "
        f"a training batch (BATCH_SIZE {batch_size} / train.microbatches "
        f"{microbatches} x SEQUENCE_LENGTH {sequence_length}); pick a divisor such as "
        f"{max(divisors)}")


def main(argv=None) -> int:
  """CLI entry point: parses gin flags, checks required bindings, trains; returns
  the exit code (see the module docstring)."""
  return PROGRAM.main(_run, argv)


if __name__ == "__main__":
  sys.exit(main())
