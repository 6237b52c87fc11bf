"""Training objectives: each calls the Decoder on a batch and returns (loss, metrics)."""
from openmoe_jax.objectives.causal_lm import CausalLm

__all__ = ["CausalLm"]
