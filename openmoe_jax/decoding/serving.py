"""The model config both decoders (autoregressive.py, diffusion.py) sample with."""
from openmoe_jax.config import ModelConfig
from openmoe_jax.moe.layer import router_of
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter


def serving_config(cfg: ModelConfig, diffusion: bool) -> ModelConfig:
  """Returns `cfg` for sampling: one routing group per call, and the evaluation
  capacity except for token choice in autoregressive decoding, which is dropless.

  Autoregressive decoding routes the prompt in one call and then one token per call
  (KV cache), or the whole buffer with placeholder tokens after the cursor (no
  cache). With a capacity, which choices are dropped would depend on that grouping
  and on the placeholders; a token-choice router serving every choice (capacity =
  tokens per group) gives each token its own top-k in every layout, so the two
  decoders agree. Diffusion sampling routes whole sequences as evaluation does, and
  an expert-choice router must keep its evaluation capacity in every mode: C = cf x k
  x T / E, whereas a capacity factor of E would make C = T, every expert taking every
  token (E experts per token in place of k). Expert choice is not causal; in KV-cached
  decoding each one-token group is taken by every expert (it suits diffusion).
  """
  moe = cfg.moe.replace(group_size=1 << 30)
  if not diffusion and isinstance(router_of(cfg.moe), TokenChoiceRouter):
    # capacity >= round(E x s / E) = s: every choice of every token is served.
    moe = moe.replace(capacity_factor_eval=float(max(cfg.moe.num_experts, 1)))
  return cfg.replace(moe=moe)
