"""Training objectives: each calls the Decoder on a batch and returns (loss, metrics)."""
from openmoe_jax.objectives.causal_lm import CausalLm
from openmoe_jax.objectives.diffusion import MaskedDiffusion, diffusion_elbo

__all__ = ["CausalLm", "MaskedDiffusion", "diffusion_elbo"]
