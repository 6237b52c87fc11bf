"""Evaluation of masked-diffusion models: the ELBO perplexity bound over batches.

`openmoe-eval` (cli/evaluate.py) uses it for masked-diffusion runs; causal LM and UL2
runs are evaluated by the trainer's eval step (cross-entropy and perplexity).
"""
import math
from typing import Any, Dict

import jax

from openmoe_jax.model import Decoder
from openmoe_jax.objectives import MaskedDiffusion, diffusion_elbo


def evaluate_diffusion(model: Decoder, params: Any, batches, objective: MaskedDiffusion,
                       mask_id: int, num_samples: int, seed: int = 0) -> Dict[str, float]:
  """Returns the token-weighted negative ELBO over `batches`, its standard error
  (batches independent) and the perplexity bound exp(nelbo)."""
  total = weight = var = 0.0
  for i, batch in enumerate(batches):
    result = diffusion_elbo(model, params, batch, jax.random.PRNGKey(seed + i),
                            num_samples, mask_id=mask_id, eps=objective.eps)
    n = result["num_tokens"]
    total += result["nelbo"] * n
    var += (result["stderr"] * n) ** 2
    weight += n
  if weight == 0:
    raise ValueError("evaluation saw no target tokens: is the split empty?")
  nelbo = total / weight
  return {"nelbo": nelbo, "stderr": math.sqrt(var) / weight,
          "perplexity_bound": math.exp(nelbo), "num_tokens": weight,
          "num_samples": num_samples}
