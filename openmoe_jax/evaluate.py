"""Held-out negative log-likelihood in nats per token, for both objectives.

- causal LM: `evaluate_causal`, the exact NLL of the next token (teacher forcing);
- masked diffusion: `evaluate_diffusion`, the Monte Carlo negative ELBO, an upper
  bound on the NLL, with its standard error.

Both average over the same target tokens (the batches' loss weights), so the two
numbers are comparable: a diffusion bound below a causal NLL means the diffusion
model is the better one on those tokens. `openmoe-eval` (cli/evaluate.py) uses
`evaluate_diffusion` for masked-diffusion runs (causal LM and UL2 runs are
evaluated by the trainer's eval step); the double-win study
(studies/double_win.py) uses `heldout_nll` for all four arms.
"""
import functools
import math
from typing import Any, Dict, Iterable, Optional

import jax
import jax.numpy as jnp

from openmoe_jax.model import Decoder
from openmoe_jax.objectives import (CausalLm, MaskedDiffusion, diffusion_elbo,
                                    diffusion_mask_id, is_diffusion)


@functools.lru_cache(maxsize=16)
def _compiled_causal_ce(model: Decoder, attention_kind: str):
  """Returns the jitted (params, batch) -> (CE summed over loss tokens, tokens)."""
  objective = CausalLm(z_loss=0.0, attention_kind=attention_kind)

  def ce_sum(params, batch):
    _, metrics = objective(model, params, batch, jax.random.PRNGKey(0), train=False)
    return metrics["ce_loss"] * metrics["num_tokens"], metrics["num_tokens"]
  return jax.jit(ce_sum)


def evaluate_causal(model: Decoder, params: Any, batches: Iterable[Dict[str, Any]],
                    objective: CausalLm = CausalLm()) -> Dict[str, float]:
  """Returns the exact token-weighted NLL of the next token over `batches`
  ({"nll", "num_tokens"}; no z-loss, no router losses)."""
  ce_sum = _compiled_causal_ce(model, objective.attention_kind)
  total = weight = 0.0
  for batch in batches:
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    value, tokens = jax.device_get(ce_sum(params, batch))
    total += float(value)
    weight += float(tokens)
  if weight == 0:
    raise ValueError("evaluation saw no target tokens: is the split empty?")
  return {"nll": total / weight, "num_tokens": weight}


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


def heldout_nll(model: Decoder, params: Any, batches, objective: Any,
                num_samples: int = 8, seed: int = 0,
                mask_id: Optional[int] = None) -> Dict[str, Any]:
  """Returns {"nll", "stderr", "bound", "num_tokens"}: nats per target token of
  `batches` under `objective`'s model. Causal LM: exact (stderr 0, bound False).
  Masked diffusion: the negative ELBO over `num_samples` mask draws per batch (LLaDA's
  estimator), an upper bound on the NLL (bound True) with its Monte Carlo standard
  error. `mask_id` None: the objective's, else the gin vocabulary's `<mask>`."""
  batches = list(batches)
  if is_diffusion(objective):
    if mask_id is None:
      mask_id = (diffusion_mask_id() if objective.mask_id is None
                 else objective.mask_id)
    result = evaluate_diffusion(model, params, batches, objective, mask_id,
                                num_samples, seed)
    return {"nll": result["nelbo"], "stderr": result["stderr"], "bound": True,
            "num_tokens": result["num_tokens"]}
  if not isinstance(objective, CausalLm):
    raise ValueError(f"heldout_nll needs CausalLm or MaskedDiffusion, got "
                     f"{type(objective).__name__}")
  result = evaluate_causal(model, params, batches, objective)
  return {"nll": result["nll"], "stderr": 0.0, "bound": False,
          "num_tokens": result["num_tokens"]}
