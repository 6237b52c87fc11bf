"""Total and activated parameter counts of any gin-configured model.

`openmoe-params --gin_file=models/openmoe_8b_32e.gin` prints them without allocating
the model (jax.eval_shape). "Activated" counts what one token touches: every
non-expert parameter plus top_k of the E experts in each MoE layer.
"""
import math
import sys
from typing import Dict

import flax.linen as nn
import jax
import jax.numpy as jnp

from openmoe_jax import gin_utils
from openmoe_jax.cli import flags
from openmoe_jax.config import ModelConfig
from openmoe_jax.model import Decoder


def count_params(cfg: ModelConfig) -> Dict[str, int]:
  """Returns counts: total, activated, embedding (input table + head), experts
  (all routed expert weights) and activated_non_embedding."""
  tokens = jax.ShapeDtypeStruct((1, min(cfg.moe.group_size, 8)), jnp.int32)
  abstract = jax.eval_shape(Decoder(cfg).init, jax.random.PRNGKey(0), tokens)
  leaves = jax.tree_util.tree_leaves_with_path(
      _strip(abstract["params"]))
  counts = {"total": 0, "embedding": 0, "experts": 0}
  for path, leaf in leaves:
    size = math.prod(leaf.shape)
    keys = [getattr(k, "key", str(k)) for k in path]
    counts["total"] += size
    if keys[0] in ("embed", "head"):
      counts["embedding"] += size
    if "experts" in keys:
      counts["experts"] += size
  unused_share = 1 - cfg.moe.top_k / cfg.moe.num_experts
  counts["activated"] = counts["total"] - round(counts["experts"] * unused_share)
  counts["activated_non_embedding"] = counts["activated"] - counts["embedding"]
  return counts


def _strip(tree):
  is_box = lambda x: isinstance(x, nn.Partitioned)
  return jax.tree.map(lambda x: x.value if is_box(x) else x, tree, is_leaf=is_box)


def format_counts(name: str, counts: Dict[str, int]) -> str:
  """Returns a one-line human summary of `count_params` output."""
  b = lambda n: f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
  return (f"{name}: total {b(counts['total'])}, activated {b(counts['activated'])} "
          f"(non-embedding {b(counts['activated_non_embedding'])}), embedding + head "
          f"{b(counts['embedding'])}, routed experts {b(counts['experts'])}")


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
