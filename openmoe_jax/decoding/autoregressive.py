"""Autoregressive decoding (greedy, temperature, top-p) for causal LM and UL2 models.

Decoding keeps a KV cache (one prefill of the prompt, then one token per step);
`kv_cache=False` re-reads the whole buffer each step instead (the plain reference).
Give the model `serving.serving_config(cfg, diffusion=False)` (dropless token-choice
routing) so that both ways agree.
"""
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from openmoe_jax.model import Decoder


def filter_top_p(logits_v: jax.Array, top_p: float) -> jax.Array:
  """Returns logits with the tokens outside the smallest set of probability mass
  >= top_p set to -inf (the most likely token always stays)."""
  order_v = jnp.argsort(-logits_v)
  probs_v = jax.nn.softmax(logits_v[order_v])
  keep_sorted_v = jnp.cumsum(probs_v) - probs_v < top_p
  keep_v = jnp.zeros_like(keep_sorted_v).at[order_v].set(keep_sorted_v)
  return jnp.where(keep_v, logits_v, -jnp.inf)


@functools.lru_cache(maxsize=8)
def _next_token_fn(model: Decoder, temperature: float, top_p: float,
                   vocab_limit: Optional[int]):
  """Returns a jitted (params, tokens_1t, cursor, rng) -> next token id."""
  def next_token(params, tokens_1t, cursor, rng):
    logits_1tv, _ = model.apply({"params": params}, tokens_1t, train=False)
    logits_v = jax.lax.dynamic_index_in_dim(logits_1tv[0], cursor - 1, keepdims=False)
    return _choose(logits_v, rng, temperature, top_p, vocab_limit)
  return jax.jit(next_token)


def _choose(logits_v, rng, temperature: float, top_p: float, vocab_limit):
  """Returns the next token id from one position's logits."""
  if vocab_limit is not None:
    logits_v = jnp.where(jnp.arange(logits_v.shape[0]) < vocab_limit, logits_v, -jnp.inf)
  if temperature == 0.0:
    return jnp.argmax(logits_v)
  return jax.random.categorical(rng, filter_top_p(logits_v / temperature, top_p))


@functools.lru_cache(maxsize=8)
def _cached_fns(model: Decoder, temperature: float, top_p: float,
                vocab_limit: Optional[int]):
  """Returns jitted (prefill, step) functions that carry the KV cache."""
  def run(params, cache, tokens_1t, start, rng):
    positions_1t = start + jnp.arange(tokens_1t.shape[1])[None]
    (logits_1tv, _), state = model.apply(
        {"params": params, "cache": cache}, tokens_1t, positions_bt=positions_1t,
        train=False, mutable=["cache"])
    return _choose(logits_1tv[0, -1], rng, temperature, top_p, vocab_limit), \
        state["cache"]
  return jax.jit(run), jax.jit(run)


def _empty_cache(model: Decoder, params: Any, length: int):
  """Returns a zero KV cache for one sequence of `length` tokens."""
  create = lambda p: model.apply({"params": p}, jnp.zeros((1, length), jnp.int32),
                                 train=False, mutable=["cache"])[1]["cache"]
  shapes = jax.eval_shape(create, params)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def sample_autoregressive(model: Decoder, params: Any, prompt_ids, *, max_new_tokens: int,
                          temperature: float = 0.0, top_p: float = 1.0,
                          rng: Optional[jax.Array] = None, eos_id: Optional[int] = None,
                          vocab_limit: Optional[int] = None,
                          kv_cache: bool = True) -> np.ndarray:
  """Returns the prompt followed by up to `max_new_tokens` sampled ids (stops after
  `eos_id`). temperature 0 is greedy; top_p < 1 samples from the nucleus."""
  prompt = [int(i) for i in prompt_ids] or [0]  # seqio decoders start from id 0
  rng = jax.random.PRNGKey(0) if rng is None else rng
  if kv_cache:
    return _sample_with_cache(model, params, prompt, max_new_tokens, temperature, top_p,
                              rng, eos_id, vocab_limit)
  tokens_1t = np.zeros((1, len(prompt) + max_new_tokens), np.int32)
  tokens_1t[0, :len(prompt)] = prompt
  step = _next_token_fn(model, float(temperature), float(top_p), vocab_limit)
  cursor = len(prompt)
  for i in range(max_new_tokens):
    token = int(step(params, jnp.asarray(tokens_1t), cursor, jax.random.fold_in(rng, i)))
    tokens_1t[0, cursor] = token
    cursor += 1
    if token == eos_id:
      break
  return tokens_1t[0, :cursor]


def _sample_with_cache(model, params, prompt, max_new_tokens, temperature, top_p, rng,
                       eos_id, vocab_limit) -> np.ndarray:
  """KV-cached decoding: prefill the prompt once, then one token per call."""
  prefill, step = _cached_fns(model, float(temperature), float(top_p), vocab_limit)
  cache = _empty_cache(model, params, len(prompt) + max_new_tokens)
  out = list(prompt)
  token, cache = prefill(params, cache, jnp.asarray([prompt], jnp.int32), 0,
                         jax.random.fold_in(rng, 0))
  for i in range(max_new_tokens):
    out.append(int(token))
    if out[-1] == eos_id or i == max_new_tokens - 1:
      break
    token, cache = step(params, cache, jnp.asarray([[out[-1]]], jnp.int32), len(out) - 1,
                        jax.random.fold_in(rng, i + 1))
  return np.asarray(out, np.int32)
