"""`openmoe-params --gin_file=models/openmoe_8b_32e.gin`: print the total and
activated parameter counts of a gin-configured model (param_count.py) without
allocating it.
"""
import sys

from openmoe_jax import gin_utils
from openmoe_jax.cli import flags
from openmoe_jax.config import ModelConfig
from openmoe_jax.param_count import count_params, format_counts

PROGRAM = flags.Program(
    "openmoe-params",
    "Print the total and activated parameter counts of a gin-configured model "
    "without allocating it (jax.eval_shape). Activated: what one token touches, "
    "every non-expert parameter plus top_k of the E experts of each MoE layer.",
    ["openmoe-params --gin_file=models/openmoe_8b_32e.gin",
     "openmoe-params --gin_file=models/quickstart_moe.gin "
     "--gin.ModelConfig.vocab_size=8192"],
    gin=True)


def _run(args, gin_flags: flags.GinFlags) -> int:
  del args
  if not gin_flags.files:
    raise flags.UsageError("--gin_file is required: the model to count")
  gin_utils.import_configurables()
  gin_utils.parse_gin(gin_flags.files, gin_flags.bindings, gin_flags.search_paths,
                      finalize=False)
  cfg = ModelConfig()
  if cfg.vocab_size is None:
    raise flags.UsageError("the model's vocab_size is unset: add "
                           "--gin.ModelConfig.vocab_size=N")
  print(format_counts(", ".join(gin_flags.files), count_params(cfg)))
  return 0


def main(argv=None) -> int:
  """CLI: parses gin flags, prints the model's parameter counts; returns the exit
  code (0, or 2 on bad input)."""
  return PROGRAM.main(_run, argv)


if __name__ == "__main__":
  sys.exit(main())
