"""Per-token routing decisions out of a Decoder call, in MoE-layer order.

`MoeLayer` sows `routing` = {expert_index, gates, kept}, each [b, t, k], into the
"intermediates" collection. Under a scanned segment `layers_<i>` the arrays carry a
leading repeats axis; with `scan_layers=False` each repeat is its own module
`layers_<i>_<r>`. `flatten_routing` undoes both layouts.
"""
from typing import Any, Dict, List, Mapping

import jax.numpy as jnp

from openmoe_jax.config import ModelConfig
from openmoe_jax.model import layer_segments

ROUTING_KEYS = ("expert_index", "gates", "kept")


def moe_layer_numbers(cfg: ModelConfig) -> List[int]:
  """Returns the model layer numbers (0-based) of the MoE layers, in order."""
  return [i for i, sparse in enumerate(cfg.sparse_layers()) if sparse]


def _sown(tree: Mapping[str, Any], block: int) -> Dict[str, Any]:
  routing = tree[f"block_{block}"]["moe"]["routing"]
  return routing[0] if isinstance(routing, tuple) else routing


def flatten_routing(intermediates: Mapping[str, Any], cfg: ModelConfig
                    ) -> Dict[str, jnp.ndarray]:
  """Returns {expert_index, gates, kept}, each [L_moe, b, t, k], in layer order.

  `intermediates` is `state["intermediates"]` of
  `Decoder(cfg).apply(..., mutable=["intermediates"])`. Layer order matches the
  model's per-layer aux (`drop_fraction`, `expert_load`): segments in order, and
  within a segment repeat-major, then block index.
  """
  per_layer: List[Dict[str, Any]] = []
  unit_length = cfg.sparse_interval or 1
  for i, (unit, repeats) in enumerate(layer_segments(cfg.sparse_layers(), unit_length)):
    blocks = [j for j, sparse in enumerate(unit) if sparse]
    if not blocks:
      continue
    for r in range(repeats):
      for j in blocks:
        if cfg.scan_layers:
          routing = _sown(intermediates[f"layers_{i}"], j)
          per_layer.append({k: routing[k][r] for k in ROUTING_KEYS})
        else:
          per_layer.append(dict(_sown(intermediates[f"layers_{i}_{r}"], j)))
  if not per_layer:
    raise ValueError("the model has no MoE layer: nothing to analyse")
  return {k: jnp.stack([layer[k] for layer in per_layer]) for k in ROUTING_KEYS}
