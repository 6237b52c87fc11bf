"""Training objectives: each calls the Decoder on a batch and returns (loss, metrics).

`is_diffusion(objective)` is the one place that tells a masked-diffusion objective
(bidirectional, decoded by iterative unmasking, evaluated by its ELBO) from the
autoregressive ones (causal LM, UL2's prefix LM).
"""
from typing import Any

from openmoe_jax.objectives.causal_lm import CausalLm
from openmoe_jax.objectives.diffusion import (MaskedDiffusion, diffusion_elbo,
                                              diffusion_mask_id)

__all__ = ["CausalLm", "MaskedDiffusion", "diffusion_elbo", "diffusion_mask_id",
           "is_diffusion"]


def is_diffusion(objective: Any) -> bool:
  """Returns whether `objective` is a masked-diffusion objective (None, a run
  without one, is causal LM: False)."""
  return isinstance(objective, MaskedDiffusion)
