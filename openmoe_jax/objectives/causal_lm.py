"""Causal language modelling: next-token cross-entropy with a causal mask."""
import dataclasses
from typing import Any, Dict, Tuple

import flax.linen as nn
import gin
import jax

from openmoe_jax.objectives.common import (moe_layer_numbers, moe_metrics,
                                           weighted_cross_entropy)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CausalLm:
  """Next-token prediction on seqio decoder batches (inputs are shifted targets).

  `z_loss` is t5x's output-logit z-loss weight (OpenMoE: 1e-4).
  """

  z_loss: float = 1e-4
  attention_kind: str = "causal"

  def __call__(self, model: nn.Module, params: Any, batch: Dict[str, jax.Array],
               rng: jax.Array, *, train: bool) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """Returns (total loss incl. router aux losses, dict of scalar metrics)."""
    logits_btv, aux = model.apply(
        {"params": params}, batch["decoder_input_tokens"],
        positions_bt=batch.get("decoder_positions"),
        segment_ids_bt=batch.get("decoder_segment_ids"),
        prefix_bt=batch.get("decoder_causal_attention"),
        attention_kind=self.attention_kind, train=train, rngs={"jitter": rng})
    lm_loss, metrics = weighted_cross_entropy(
        logits_btv, batch["decoder_target_tokens"], batch["decoder_loss_weights"],
        self.z_loss)
    loss = lm_loss + aux["aux_loss"]
    metrics.update(moe_metrics(aux, moe_layer_numbers(model)))
    metrics["loss"] = loss
    return loss, metrics
