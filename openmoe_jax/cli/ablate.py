"""`openmoe-ablate`: train OpenMoE 2 ablation arms side by side and print one table
row (or JSON object) per arm (ablate.py), or run a study of several arms
(studies/: --study=double_win).

  openmoe-ablate [--arms=tc_softmax,ec_batch,...] [--steps=100] [--output=DIR]
                 [--run_gin=runs/ablate_tiny.gin] [--gin.NAME=VALUE ...] [--json]
  openmoe-ablate --study=double_win [--steps=1000] [--unique_tokens=50000]
                 [--output=DIR] [--gin.NAME=VALUE ...]
"""
import dataclasses
import json
import sys

from openmoe_jax import gin_utils
from openmoe_jax.ablate import (available_arms, format_table, run_arms,
                                short_run_bindings)
from openmoe_jax.cli import flags
from openmoe_jax.studies import double_win, double_win_report

STUDIES = ("double_win",)
ARMS_STEPS = 100

PROGRAM = flags.Program(
    "openmoe-ablate",
    "Train OpenMoE 2 ablation arms (gin files under gin/experiments/openmoe2/) with "
    "the same run file, steps and seed, one MODEL_DIR each under --output, and print "
    "one table row per arm: validation loss at the start and the end, drop fraction, "
    "expert-load CV and tokens/s. The `upcycled` arm is upcycled from the `dense` "
    "arm's final checkpoint (trained first if not asked for).",
    ["openmoe-ablate --steps=100",
     "openmoe-ablate --arms=tc_softmax,ec_batch --steps=10 --output=/tmp/abl",
     "openmoe-ablate --list",
     "openmoe-ablate --study=double_win --output=/tmp/double_win"],
    gin=True,
    details="The arms pick the models: give training settings with --run_gin and "
    "overrides with --gin.NAME=VALUE\n(no --gin_file). A warmup as long as --steps is "
    "shortened to steps // 10 (said in the output).\n\n--study=double_win: AR vs "
    "masked diffusion x dense vs MoE at equal activated parameters, on a fixed "
    "subset\nof --unique_tokens corpus tokens repeated for many epochs; writes "
    "report.md, double_win.png and\ndouble_win.json under --output (rerun the same "
    "line to resume). --run_gin defaults to\nruns/double_win.gin; the models to "
    "--dense_model and --moe_model.")
PROGRAM.add("--arms", default=None, metavar="A,B,...",
            help="comma-separated arms (default: all; see --list)")
PROGRAM.add("--steps", type=flags.int_at_least(1), default=None,
            help=f"training steps per arm (default {ARMS_STEPS}; study: "
                 f"{double_win.StudySettings.steps})")
PROGRAM.add("--output", default=None, metavar="DIR",
            help="one MODEL_DIR per arm is created under it (default "
                 "/tmp/openmoe_ablate, study: /tmp/openmoe_<study>)")
PROGRAM.add("--run_gin", default=None, metavar="FILE",
            help="run file with the training settings shared by the arms (default "
                 "runs/ablate_tiny.gin; study: runs/double_win.gin)")
PROGRAM.add("--study", default=None, choices=STUDIES,
            help="run a study instead of --arms (see below)")
PROGRAM.add("--unique_tokens", type=flags.int_at_least(1), default=None,
            help="study: unique training tokens, repeated (default "
                 f"{double_win.StudySettings.unique_tokens})")
PROGRAM.add("--validation_tokens", type=flags.int_at_least(1), default=None,
            help="study: held-out tokens scored at every checkpoint (default "
                 f"{double_win.StudySettings.validation_tokens})")
PROGRAM.add("--eval_points", type=flags.int_at_least(1), default=None,
            help="study: checkpoints kept and scored per arm (default "
                 f"{double_win.StudySettings.eval_points})")
PROGRAM.add("--dlm_samples", type=flags.int_at_least(2), default=None,
            help="study: mask draws per held-out batch for the diffusion bound "
                 f"(default {double_win.StudySettings.dlm_samples})")
PROGRAM.add("--dense_model", default=None, metavar="FILE",
            help="study: the dense arms' model gin (default "
                 f"{double_win.StudySettings.dense_gin})")
PROGRAM.add("--moe_model", default=None, metavar="FILE",
            help="study: the MoE arms' model gin (default "
                 f"{double_win.StudySettings.moe_gin})")
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
  if args.study:
    return _run_study(args, gin_flags)
  study_only = [name for name in ("unique_tokens", "validation_tokens", "eval_points",
                                  "dlm_samples", "dense_model", "moe_model")
                if getattr(args, name) is not None]
  if study_only:
    raise flags.UsageError(f"--{study_only[0]} needs --study")
  args.steps = args.steps or ARMS_STEPS
  args.output = args.output or "/tmp/openmoe_ablate"
  args.run_gin = args.run_gin or "runs/ablate_tiny.gin"
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


def _run_study(args, gin_flags: flags.GinFlags) -> int:
  """Runs --study=double_win; prints the table and where the report is."""
  if args.arms or args.json:
    raise flags.UsageError("--study takes no --arms or --json (the study's arms are "
                           "fixed; its JSON is written under --output)")
  defaults = double_win.StudySettings()
  settings = double_win.StudySettings(
      steps=args.steps or defaults.steps,
      unique_tokens=args.unique_tokens or defaults.unique_tokens,
      validation_tokens=args.validation_tokens or defaults.validation_tokens,
      eval_points=args.eval_points or defaults.eval_points,
      dlm_samples=args.dlm_samples or defaults.dlm_samples,
      run_gin=args.run_gin or defaults.run_gin,
      dense_gin=args.dense_model or defaults.dense_gin,
      moe_gin=args.moe_model or defaults.moe_gin)
  bindings, note = short_run_bindings(settings.run_gin, settings.steps,
                                      gin_flags.bindings)
  if note:
    print(note)
  settings = dataclasses.replace(settings, bindings=tuple(bindings))
  output = args.output or f"/tmp/openmoe_{args.study}"
  results = double_win.run_study(settings, output)
  paths = double_win_report.write_report(results, output)
  print("\n" + double_win_report.format_table(results))
  print("\n" + "\n".join(double_win_report.answers(results)))
  print(f"\nreport: {paths['markdown']}; plot: {paths['plot']}; JSON: {paths['json']}")
  return 0


def main(argv=None) -> int:
  """CLI entry point; returns the exit code (0, or 2 on bad input)."""
  return PROGRAM.main(_run, argv)


if __name__ == "__main__":
  sys.exit(main())
