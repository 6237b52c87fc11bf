"""Pieces every objective shares: weighted cross-entropy and MoE metric summaries."""
from typing import Dict, Tuple

import jax
import jax.numpy as jnp
import optax


def weighted_cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array,
                           weights_bt: jax.Array, z_loss: float = 0.0
                           ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
  """Returns (mean CE + z_loss * mean logsumexp^2 over weighted tokens, metrics).

  The mean is over the real target tokens (sum of weights), as OpenMoE normalised.
  """
  logits = logits_btv.astype(jnp.float32)
  weights = weights_bt.astype(jnp.float32)
  num_tokens = jnp.maximum(jnp.sum(weights), 1.0)
  ce_bt = optax.softmax_cross_entropy_with_integer_labels(logits, targets_bt)
  lse_bt = jax.nn.logsumexp(logits, axis=-1)
  ce = jnp.sum(ce_bt * weights) / num_tokens
  zl = jnp.sum(lse_bt ** 2 * weights) / num_tokens
  correct = (jnp.argmax(logits, axis=-1) == targets_bt).astype(jnp.float32)
  metrics = {"ce_loss": ce, "logits_z_loss": zl,
             "accuracy": jnp.sum(correct * weights) / num_tokens,
             "num_tokens": jnp.sum(weights)}
  return ce + z_loss * zl, metrics


def moe_metrics(aux: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
  """Returns scalar MoE metrics: router losses, mean and per-layer drop fraction
  (overall, first and last quarter of positions), router entropy and expert-load
  coefficient of variation."""
  metrics = {"moe/aux_loss": aux["aux_loss"], "moe/lb_loss": aux["lb_loss"],
             "moe/z_loss": aux["z_loss"]}
  if "drop_fraction" not in aux:
    return metrics
  load_le = aux["expert_load"]
  cv_l = jnp.std(load_le, axis=-1) / jnp.maximum(jnp.mean(load_le, axis=-1), 1e-9)
  metrics["moe/drop_fraction"] = jnp.mean(aux["drop_fraction"])
  for part in ("first", "last"):
    name = f"drop_fraction_{part}_quarter"
    metrics[f"moe/{name}"] = jnp.mean(aux[name])
  metrics["moe/router_entropy"] = jnp.mean(aux["router_entropy"])
  metrics["moe/expert_load_cv"] = jnp.mean(cv_l)
  if "tokenwise_lb_loss" in aux:
    metrics["moe/tokenwise_lb_loss"] = aux["tokenwise_lb_loss"]
  if "no_expert_fraction" in aux:
    metrics["moe/no_expert_fraction"] = jnp.mean(aux["no_expert_fraction"])
    metrics["moe/experts_per_token_mean"] = jnp.mean(aux["experts_per_token_mean"])
    metrics["moe/experts_per_token_min"] = jnp.min(aux["experts_per_token_min"])
    metrics["moe/experts_per_token_max"] = jnp.max(aux["experts_per_token_max"])
  for i in range(load_le.shape[0]):
    metrics[f"moe/layer_{i}/drop_fraction"] = aux["drop_fraction"][i]
    for part in ("first", "last"):
      name = f"drop_fraction_{part}_quarter"
      metrics[f"moe/layer_{i}/{name}"] = aux[name][i]
    metrics[f"moe/layer_{i}/expert_load_cv"] = cv_l[i]
  return metrics
