"""Masked diffusion LM objective (MDLM, LLaDA; as OpenMoE 2 trains) and its ELBO.

A clean sequence x is corrupted by replacing loss tokens with the mask token; a
bidirectional Decoder reads the corrupted sequence and every position predicts its
own clean token (no shift). The loss is the weighted cross-entropy on masked
positions, summed and divided by the number of loss tokens: in expectation an upper
bound on the NLL per token. Two weightings (`WEIGHTINGS`), each an unbiased
estimator of the same bound ("mdlm" up to t >= eps):

- "mdlm" (the training default): t ~ U(eps, 1), each loss token masked with
  probability t, weight 1/t. The continuous-time NELBO of MDLM (Sahoo et al. 2024,
  "Simple and Effective Masked Diffusion Language Models", linear schedule) and
  LLaDA's pre-training loss (Nie et al. 2025, "Large Language Diffusion Models").
- "llada_eval": l ~ U{1..L}, exactly l of the row's L loss tokens masked (a uniform
  subset), weight L/l. LLaDA's lower-variance likelihood-evaluation estimator (Nie
  et al. 2025), used by `diffusion_elbo`; it can also train.
"""
import dataclasses
import functools
from typing import Any, Dict, NamedTuple, Optional, Tuple

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from openmoe_jax.objectives.common import moe_layer_numbers, moe_metrics

WEIGHTINGS = ("mdlm", "llada_eval")
# Removed names -> what to use. "llada" weighted Bernoulli(t) masks by L / realised
# mask count and was not LLaDA's training loss.
_RENAMED = {"llada": "'mdlm' (LLaDA's and MDLM's 1/t training loss, the default) or "
                     "'llada_eval' (LLaDA's exactly-l likelihood estimator, weight L/l)"}


def check_weighting(name: str, value: str) -> None:
  """Returns None; raises ValueError if `value` is not one of WEIGHTINGS (with the
  new names when it is a removed one)."""
  if value in _RENAMED:
    raise ValueError(f"{name}={value!r} was removed; use {_RENAMED[value]}")
  if value not in WEIGHTINGS:
    raise ValueError(f"{name}={value!r}; choose one of {WEIGHTINGS}")


@gin.configurable
def diffusion_mask_id(vocabulary: Any = None) -> int:
  """Returns the mask token id of `vocabulary` (default: gin's get_vocabulary())."""
  # Imported here: the vocabulary pulls in seqio and TensorFlow.
  from openmoe_jax.data import vocabulary as vocab_lib  # pylint: disable=C0415
  return vocab_lib.mask_token_id(vocabulary or vocab_lib.get_vocabulary())


def antithetic_times(rng: jax.Array, n: int, eps: float) -> jax.Array:
  """Returns t_b [n] float32 in [eps, 1): (u + i/n) mod 1 mapped onto [eps, 1)."""
  u = jax.random.uniform(rng, (), jnp.float32)
  s_b = jnp.mod(u + jnp.arange(n, dtype=jnp.float32) / n, 1.0)
  return eps + (1.0 - eps) * s_b


def bernoulli_mask(rng: jax.Array, loss_bt: jax.Array, t_b: jax.Array,
                   force_one: bool = False) -> jax.Array:
  """Returns bool masked_bt: each loss token masked with probability t_b[row].

  With `force_one`, a row with loss tokens but no mask gets one (uniformly chosen).
  """
  scores_bt = jax.random.uniform(rng, loss_bt.shape, jnp.float32)
  masked_bt = (scores_bt < t_b[:, None]) & loss_bt
  if not force_one:
    return masked_bt
  empty_b = ~jnp.any(masked_bt, axis=-1) & jnp.any(loss_bt, axis=-1)
  pick_b = jnp.argmin(jnp.where(loss_bt, scores_bt, jnp.inf), axis=-1)
  pick_bt = jnp.arange(loss_bt.shape[1])[None, :] == pick_b[:, None]
  return masked_bt | (empty_b[:, None] & pick_bt)


def exact_count_mask(rng: jax.Array, loss_bt: jax.Array, count_b: jax.Array) -> jax.Array:
  """Returns bool masked_bt with exactly min(count_b, loss tokens) loss tokens of each
  row masked, the subset uniform at random."""
  scores_bt = jnp.where(loss_bt, jax.random.uniform(rng, loss_bt.shape), jnp.inf)
  rank_bt = jnp.argsort(jnp.argsort(scores_bt, axis=-1), axis=-1)
  return (rank_bt < count_b[:, None]) & loss_bt


def draw_masks(rng: jax.Array, loss_bt: jax.Array, weighting: str, eps: float,
               force_one: bool = False) -> Tuple[jax.Array, jax.Array]:
  """Returns (masked_bt bool, t_b float32 [b]) for one draw of `weighting`'s masks.

  "mdlm": t_b antithetic in [eps, 1), Bernoulli(t_b) masks (`force_one`: see
  bernoulli_mask). "llada_eval": l_b = 1 + floor(s_b L_b) with s_b antithetic in
  [0, 1), so l_b ~ U{1..L_b}; exactly l_b loss tokens masked; t_b = l_b / L_b.
  """
  t_rng, mask_rng = jax.random.split(rng)
  b = loss_bt.shape[0]
  if weighting == "mdlm":
    t_b = antithetic_times(t_rng, b, eps)
    return bernoulli_mask(mask_rng, loss_bt, t_b, force_one), t_b
  loss_tokens_b = jnp.sum(loss_bt, axis=-1)
  s_b = antithetic_times(t_rng, b, 0.0)
  count_b = jnp.clip(1 + jnp.floor(s_b * loss_tokens_b).astype(jnp.int32), 1,
                     jnp.maximum(loss_tokens_b, 1))
  t_b = count_b / jnp.maximum(loss_tokens_b, 1).astype(jnp.float32)
  return exact_count_mask(mask_rng, loss_bt, count_b), t_b.astype(jnp.float32)


def mask_weights(weighting: str, masked_bt: jax.Array, loss_bt: jax.Array,
                 t_b: jax.Array) -> jax.Array:
  """Returns float32 weight_b of each row's masked CE: 1/t_b ("mdlm") or L/l, loss
  tokens over masked tokens ("llada_eval", 0 masked counts as 1)."""
  if weighting == "mdlm":
    return 1.0 / t_b.astype(jnp.float32)
  loss_tokens_b = jnp.sum(loss_bt, axis=-1).astype(jnp.float32)
  masked_b = jnp.sum(masked_bt, axis=-1).astype(jnp.float32)
  return loss_tokens_b / jnp.maximum(masked_b, 1.0)


def random_truncation(rng: jax.Array, loss_bt: jax.Array, segment_ids_bt: jax.Array,
                      prob: float) -> Tuple[jax.Array, jax.Array]:
  """Returns (loss_bt, segment_ids_bt) of the batch cut, with probability `prob`, to a
  random length in [1, t]: positions past the cut lose their loss weight and move to
  segment 0, so no kept token attends to them (shapes stay static)."""
  keep_rng, len_rng = jax.random.split(rng)
  t = loss_bt.shape[1]
  cut = jnp.where(jax.random.uniform(keep_rng) < prob,
                  jax.random.randint(len_rng, (), 1, t + 1), t)
  kept_t = jnp.arange(t) < cut
  return loss_bt & kept_t[None], jnp.where(kept_t[None], segment_ids_bt, 0)


def _decoder_logits(model: nn.Module, params: Any, tokens_bt: jax.Array,
                    batch: Dict[str, jax.Array], segment_ids_bt: jax.Array,
                    rng: jax.Array, train: bool):
  """Returns (float32 logits [b, t, V], aux) of a bidirectional pass on tokens_bt."""
  logits_btv, aux = model.apply(
      {"params": params}, tokens_bt, positions_bt=batch.get("decoder_positions"),
      segment_ids_bt=segment_ids_bt, attention_kind="bidirectional", train=train,
      rngs={"jitter": rng})
  return logits_btv.astype(jnp.float32), aux


def _segments(batch: Dict[str, jax.Array]) -> jax.Array:
  """Returns the batch's segment ids, or one segment per row over non-pad targets."""
  segment_ids_bt = batch.get("decoder_segment_ids")
  if segment_ids_bt is None:
    segment_ids_bt = (batch["decoder_target_tokens"] != 0).astype(jnp.int32)
  return segment_ids_bt


def _masked_ce_sum(logits_btv, targets_bt, masked_bt, weight_b):
  """Returns (sum of weight_b-weighted CE over masked tokens, CE [b, t])."""
  ce_bt = optax.softmax_cross_entropy_with_integer_labels(logits_btv, targets_bt)
  return jnp.sum(ce_bt * masked_bt * weight_b[:, None]), ce_bt


class Corruption(NamedTuple):
  """A corrupted batch: model input, masks, noise level and loss weights."""

  tokens_bt: jax.Array  # targets with the masked positions set to the mask id
  masked_bt: jax.Array  # bool
  loss_bt: jax.Array  # bool: scored tokens (after truncation)
  t_b: jax.Array  # float32 noise level (realised mask fraction for "llada_eval")
  weight_b: jax.Array  # float32 weight of each row's masked CE
  segment_ids_bt: jax.Array


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MaskedDiffusion:
  """Masked diffusion on seqio decoder batches (reads `decoder_target_tokens` only).

  mask_id: the mask token (None: `diffusion_mask_id()`, from the gin vocabulary).
  weighting: "mdlm" (default: Bernoulli(t) masks, weight 1/t; MDLM's and LLaDA's
    training loss) or "llada_eval" (exactly l ~ U{1..L} masks, weight L/l; LLaDA's
    likelihood-evaluation estimator). See the module docstring.
  eps: "mdlm" draws t ~ U(eps, 1), antithetic across the batch.
  force_one_mask: off by default. On, a "mdlm" row with loss tokens but no mask gets
    one, which biases the 1/t estimator upwards for short rows (a row that draws no
    mask should add 0 to the bound); "llada_eval" always masks l >= 1 tokens.
  truncate_prob: probability that a training batch is cut to a random length.
  z_loss: output-logit z-loss weight over masked tokens.
  """

  mask_id: Optional[int] = None
  weighting: str = "mdlm"
  eps: float = 1e-3
  force_one_mask: bool = False
  truncate_prob: float = 0.01
  z_loss: float = 0.0

  def __post_init__(self):
    check_weighting("MaskedDiffusion.weighting", self.weighting)
    if not 0.0 <= self.eps < 1.0:
      raise ValueError(f"MaskedDiffusion.eps must be in [0, 1), got {self.eps}")

  def corrupt(self, batch: Dict[str, jax.Array], rng: jax.Array, *, train: bool
              ) -> Corruption:
    """Returns the Corruption of `batch` for one draw of the noise."""
    noise_rng, cut_rng = jax.random.split(rng)
    targets_bt = batch["decoder_target_tokens"]
    loss_bt = batch["decoder_loss_weights"] > 0
    segment_ids_bt = _segments(batch)
    if train and self.truncate_prob > 0:
      loss_bt, segment_ids_bt = random_truncation(cut_rng, loss_bt, segment_ids_bt,
                                                  self.truncate_prob)
    masked_bt, t_b = draw_masks(noise_rng, loss_bt, self.weighting, self.eps,
                                self.force_one_mask)
    mask_id = diffusion_mask_id() if self.mask_id is None else self.mask_id
    tokens_bt = jnp.where(masked_bt, mask_id, targets_bt).astype(targets_bt.dtype)
    return Corruption(tokens_bt, masked_bt, loss_bt, t_b,
                      mask_weights(self.weighting, masked_bt, loss_bt, t_b),
                      segment_ids_bt)

  def __call__(self, model: nn.Module, params: Any, batch: Dict[str, jax.Array],
               rng: jax.Array, *, train: bool) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """Returns (weighted masked CE per loss token + z-loss + router aux losses,
    dict of scalar metrics)."""
    noise_rng, jitter_rng = jax.random.split(rng)
    c = self.corrupt(batch, noise_rng, train=train)
    logits_btv, aux = _decoder_logits(model, params, c.tokens_bt, batch,
                                      c.segment_ids_bt, jitter_rng, train)
    targets_bt = batch["decoder_target_tokens"]
    masked_f = c.masked_bt.astype(jnp.float32)
    num_tokens = jnp.sum(c.loss_bt).astype(jnp.float32)
    num_masked = jnp.maximum(jnp.sum(masked_f), 1.0)
    ce_sum, _ = _masked_ce_sum(logits_btv, targets_bt, masked_f, c.weight_b)
    ce = ce_sum / jnp.maximum(num_tokens, 1.0)
    lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    zl = jnp.sum(lse_bt ** 2 * masked_f) / num_masked
    correct_bt = (jnp.argmax(logits_btv, axis=-1) == targets_bt).astype(jnp.float32)
    masked_accuracy = jnp.sum(correct_bt * masked_f) / num_masked
    loss = ce + self.z_loss * zl + aux["aux_loss"]
    metrics = {"loss": loss, "ce_loss": ce, "logits_z_loss": zl,
               # accuracy is over the tokens the model cannot see, like causal LM's.
               "accuracy": masked_accuracy, "masked_accuracy": masked_accuracy,
               "mask_fraction": jnp.sum(masked_f) / jnp.maximum(num_tokens, 1.0),
               "mean_t": jnp.mean(c.t_b), "num_tokens": num_tokens}
    metrics.update(moe_metrics(aux, moe_layer_numbers(model)))
    return loss, metrics


def _elbo_sample(model, params, batch, rng, *, mask_id, estimator, eps):
  """Returns (weighted masked CE summed over the batch, number of loss tokens) for
  one Monte Carlo draw of the masks."""
  targets_bt = batch["decoder_target_tokens"]
  loss_bt = batch["decoder_loss_weights"] > 0
  masked_bt, t_b = draw_masks(rng, loss_bt, estimator, eps)
  tokens_bt = jnp.where(masked_bt, mask_id, targets_bt).astype(targets_bt.dtype)
  logits_btv, _ = _decoder_logits(model, params, tokens_bt, batch, _segments(batch),
                                  rng, train=False)
  ce_sum, _ = _masked_ce_sum(logits_btv, targets_bt, masked_bt.astype(jnp.float32),
                             mask_weights(estimator, masked_bt, loss_bt, t_b))
  return ce_sum, jnp.sum(loss_bt).astype(jnp.float32)


@functools.lru_cache(maxsize=16)
def _compiled_elbo_sample(model, mask_id, estimator, eps):
  """Returns the jitted (params, batch, rng) -> _elbo_sample(...) for these settings."""
  return jax.jit(functools.partial(_elbo_sample, model, mask_id=mask_id,
                                   estimator=estimator, eps=eps))


def diffusion_elbo(model: nn.Module, params: Any, batch: Dict[str, Any], rng: jax.Array,
                   num_samples: int, *, mask_id: int, estimator: str = "llada_eval",
                   eps: float = 1e-3) -> Dict[str, float]:
  """Monte Carlo negative ELBO per token of a batch (an upper bound on the NLL).

  Sample s uses the key fold_in(rng, s) (reproducible); each is the batch's weighted
  masked CE over its loss tokens. estimator (one of WEIGHTINGS) "llada_eval"
  (LLaDA's estimator): l ~ U{1..L} tokens of each row masked, weight L/l (exactly
  log V for uniform predictions); "mdlm": Bernoulli(t) masks with t ~ U(eps, 1),
  weight 1/t. Returns {"nelbo": mean over samples,
  "stderr": its standard error, "perplexity_bound": exp(nelbo), "num_samples",
  "num_tokens"}.
  """
  check_weighting("estimator", estimator)
  if num_samples < 1:
    raise ValueError(f"num_samples must be >= 1, got {num_samples}")
  sample = _compiled_elbo_sample(model, int(mask_id), estimator, float(eps))
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  values = []
  for s in range(num_samples):
    ce_sum, num_tokens = jax.device_get(sample(params, batch, jax.random.fold_in(rng, s)))
    values.append(float(ce_sum) / max(float(num_tokens), 1.0))
  values = np.asarray(values, np.float64)
  stderr = (float(np.std(values, ddof=1) / np.sqrt(num_samples)) if num_samples > 1
            else float("nan"))
  nelbo = float(np.mean(values))
  return {"nelbo": nelbo, "stderr": stderr, "perplexity_bound": float(np.exp(nelbo)),
          "num_samples": num_samples, "num_tokens": float(num_tokens)}
