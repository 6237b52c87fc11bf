"""Per-token routing decisions out of a Decoder call, in MoE-layer order.

`MoeLayer` sows `routing` = {expert_index, gates, kept}, each [b, t, k], into the
"intermediates" collection, which mirrors the parameter tree: `model.layer_slots`
says where each layer's routing sits (scanned or not). `flatten_routing` reads it
back in layer order.
"""
from typing import Any, Dict, List, Mapping

import jax.numpy as jnp

from openmoe_jax.config import ModelConfig
from openmoe_jax.model import layer_slots

ROUTING_KEYS = ("expert_index", "gates", "kept")


def flatten_routing(intermediates: Mapping[str, Any], cfg: ModelConfig
                    ) -> Dict[str, jnp.ndarray]:
  """Returns {expert_index, gates, kept}, each [L_moe, b, t, k], in layer order.

  `intermediates` is `state["intermediates"]` of
  `Decoder(cfg).apply(..., mutable=["intermediates"])`; it mirrors the parameter
  tree, so `model.layer_slots` says where each layer's sown routing lives. Layer order
  matches the model's per-layer aux (`drop_fraction`, `expert_load`).
  """
  per_layer: List[Dict[str, Any]] = []
  for slot in layer_slots(cfg):
    if not slot.sparse:
      continue
    routing = intermediates[slot.segment][slot.block]["moe"]["routing"]
    routing = routing[0] if isinstance(routing, tuple) else routing
    per_layer.append({k: routing[k] if slot.repeat is None else routing[k][slot.repeat]
                      for k in ROUTING_KEYS})
  if not per_layer:
    raise ValueError("the model has no MoE layer: nothing to analyse")
  return {k: jnp.stack([layer[k] for layer in per_layer]) for k in ROUTING_KEYS}
