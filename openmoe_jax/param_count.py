"""Total and activated parameter counts of any gin-configured model, without
allocating the model (jax.eval_shape); `openmoe-params` (cli/params.py) prints
them. "Activated" counts what one token touches: every non-expert parameter plus
top_k of the E experts in each MoE layer.
"""
import math
from typing import Dict

import flax.linen as nn
import jax
import jax.numpy as jnp

from openmoe_jax.config import ModelConfig
from openmoe_jax.model import Decoder


def count_params(cfg: ModelConfig) -> Dict[str, int]:
  """Returns counts: total, activated, embedding (input table + head), experts
  (all routed expert weights), router (the routers' d x E weights) and
  activated_non_embedding."""
  tokens = jax.ShapeDtypeStruct((1, min(cfg.moe.group_size, 8)), jnp.int32)
  abstract = jax.eval_shape(Decoder(cfg).init, jax.random.PRNGKey(0), tokens)
  leaves = jax.tree_util.tree_leaves_with_path(
      _strip(abstract["params"]))
  counts = {"total": 0, "embedding": 0, "experts": 0, "router": 0}
  for path, leaf in leaves:
    size = math.prod(leaf.shape)
    keys = [getattr(k, "key", str(k)) for k in path]
    counts["total"] += size
    if keys[0] in ("embed", "head"):
      counts["embedding"] += size
    if "experts" in keys:
      counts["experts"] += size
    if "router" in keys:
      counts["router"] += size
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
