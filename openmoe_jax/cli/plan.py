"""`openmoe-plan`: compile one sharded train step of a gin-configured model for a
TPU topology on this machine and report memory, FLOPs and MFU (plan.py).

  openmoe-plan --gin_file=models/openmoe_8b_32e.gin --topology=v5p:4x4x4 \\
      --gin.BATCH_SIZE=1024 --gin.make_mesh.fsdp=-1 --gin.make_mesh.data=1 [--json]

Exit codes: 0 fits, 3 does not fit, 2 bad flags or configuration.
"""
import json
import sys

import gin

from openmoe_jax import gin_utils
from openmoe_jax.cli import flags
from openmoe_jax.plan import format_report, plan

EXIT_FITS = 0
EXIT_DOES_NOT_FIT = 3  # the plan compiled (or the compiler refused it) but > HBM

PROGRAM = flags.Program(
    "openmoe-plan",
    "Compile one sharded train step of a gin-configured model for a TPU topology on "
    "this machine (no TPU needed: libtpu's ahead-of-time compiler) and report "
    "per-device memory, FLOPs, collectives and, with --step_time, the MFU.",
    ["openmoe-plan --gin_file=models/openmoe_8b_32e.gin --topology=v5p:4x4x4 "
     "--gin.BATCH_SIZE=1024 --gin.make_mesh.fsdp=-1",
     "openmoe-plan --gin_file=models/quickstart_moe.gin "
     "--gin.ModelConfig.vocab_size=8192 --topology=v5e:2x2 --gin.BATCH_SIZE=8 "
     "--gin.SEQUENCE_LENGTH=256 --json"],
    gin=True,
    details="Batch and sequence length come from the gin macros BATCH_SIZE (default 8) "
    "and SEQUENCE_LENGTH (default 2048). The attention implementation is a gin "
    "binding, e.g. --gin.ModelConfig.attention_impl=@PlainAttention() (default "
    "AutoAttention: splash attention on TPU).\nExit codes: 0 fits, 3 DOES NOT FIT (the "
    "step needs more memory than the chips have), 2 bad flags or configuration.")
PROGRAM.add("--topology", required=True,
            help="TPU topology, e.g. v5p:2x2x1, v5e:2x2, v4:2x2x2, v6e:4x4")
PROGRAM.add("--step_time", type=float, default=None, metavar="SEC",
            help="measured seconds per step: adds the MFU to the report")
PROGRAM.add("--json", action="store_true", help="print the report as one JSON object")


def _run(args, gin_flags: flags.GinFlags) -> int:
  if not gin_flags.files:
    raise flags.UsageError("--gin_file is required: the model to plan")
  gin_utils.import_configurables()
  gin_utils.parse_gin(gin_flags.files, gin_flags.bindings, gin_flags.search_paths,
                      finalize=False, read_macros=("BATCH_SIZE", "SEQUENCE_LENGTH"))
  macro = lambda name, default: (gin.query_parameter(f"%{name}")
                                 if _has_macro(name) else default)
  report = plan(args.topology, batch_size=macro("BATCH_SIZE", 8),
                sequence_length=macro("SEQUENCE_LENGTH", 2048),
                step_time_s=args.step_time)
  print(json.dumps(report) if args.json else format_report(report))
  return EXIT_FITS if report["fits"] else EXIT_DOES_NOT_FIT


def main(argv=None) -> int:
  """CLI: openmoe-plan --gin_file=... --topology=v5p:2x2x1 [--json] [--step_time=S];
  returns 0 if the step fits, EXIT_DOES_NOT_FIT (3) if not, 2 on bad input."""
  return PROGRAM.main(_run, argv)


def _has_macro(name: str) -> bool:
  try:
    gin.query_parameter(f"%{name}")
    return True
  except ValueError:
    return False


if __name__ == "__main__":
  sys.exit(main())
