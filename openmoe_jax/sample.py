"""Sampling from a trained run: `openmoe-sample --model_dir=DIR --prompt="def f("`.

Autoregressive decoding (greedy, temperature, top-p) for causal LM / UL2 runs, and
iterative unmasking (sampling_diffusion.py) for masked-diffusion runs; `--mode=auto`
picks by the run's objective. Autoregressive decoding keeps a KV cache (one prefill
of the prompt, then one token per step); `kv_cache=False` re-reads the whole buffer
each step instead (the plain reference). Routing: see `serving_config`.
"""
import functools
import sys
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from openmoe_jax.cli import flags
from openmoe_jax.config import ModelConfig
from openmoe_jax.model import Decoder
from openmoe_jax.moe.layer import router_of
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter
from openmoe_jax.objectives import MaskedDiffusion
from openmoe_jax.sampling_diffusion import sample_diffusion


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


PROGRAM = flags.Program(
    "openmoe-sample",
    "Print the continuation of --prompt sampled from a trained run (a training "
    "MODEL_DIR or a params export): autoregressive decoding with a KV cache (greedy, "
    "temperature, top-p) for causal LM and UL2 runs, iterative unmasking for "
    "masked-diffusion runs (--mode=auto picks by the run's objective).",
    ["openmoe-sample --model_dir=/tmp/openmoe_quickstart --prompt='def main('",
     "openmoe-sample --model_dir=/tmp/run --prompt='The ' --temperature=0.8 "
     "--top_p=0.9 --max_new_tokens=128"])
PROGRAM.add("--model_dir", required=True, help="training MODEL_DIR or params export")
PROGRAM.add("--prompt", default="")
PROGRAM.add("--mode", choices=["auto", "ar", "diffusion"], default="auto")
PROGRAM.add("--step", type=int, help="checkpoint step (default: latest)")
PROGRAM.add("--max_new_tokens", type=int, default=64)
PROGRAM.add("--temperature", type=float, default=0.0, help="0: greedy")
PROGRAM.add("--top_p", type=float, default=1.0)
PROGRAM.add("--steps", type=int, default=32, help="diffusion: denoising steps")
PROGRAM.add("--block_length", type=int, help="diffusion: semi-AR block length")
PROGRAM.add("--remasking", choices=["low_confidence", "random"],
            default="low_confidence")
PROGRAM.add("--seed", type=int, default=0)


def _run(args, gin_flags) -> int:
  del gin_flags
  from openmoe_jax import run_loader  # pylint: disable=g-import-not-at-top
  from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  run = run_loader.load_run(args.model_dir)
  params = run_loader.restore_params(args.model_dir, args.step or run.steps[-1])
  vocab = pipeline.vocabulary_for(run.mixture_or_task_name)
  objective = run_loader.query("train.objective")
  diffusion = args.mode == "diffusion" or (
      args.mode == "auto" and isinstance(objective, MaskedDiffusion))
  model = Decoder(serving_config(run.config, diffusion))
  prompt_ids = vocab.encode(args.prompt)
  rng = jax.random.PRNGKey(args.seed)
  if diffusion:  # the diffusion objective reads targets: no start token
    prompt_ids = prompt_ids or [0]
    out = sample_diffusion(model, params, prompt_ids, gen_length=args.max_new_tokens,
                           steps=args.steps, block_length=args.block_length,
                           remasking=args.remasking, temperature=args.temperature,
                           rng=rng, mask_id=run_loader.run_mask_id(objective, vocab),
                           vocab_limit=vocab.vocab_size)[0]
  else:
    # Training inputs are targets shifted right behind a 0 (seqio's decoder feature
    # converter; OpenMoE's umT5 BOS): every sequence starts with 0.
    prompt_ids = [0] + prompt_ids
    out = sample_autoregressive(model, params, prompt_ids, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_p=args.top_p, rng=rng,
                                eos_id=vocab.eos_id, vocab_limit=vocab.vocab_size)
  new_ids = [int(i) for i in out[len(prompt_ids):]]
  if vocab.eos_id in new_ids:
    new_ids = new_ids[:new_ids.index(vocab.eos_id)]
  print(args.prompt + vocab.decode(new_ids))
  return 0


def main(argv=None) -> int:
  """CLI: prints the continuation of --prompt sampled from --model_dir; returns the
  exit code (0, or 2 on bad input)."""
  return PROGRAM.main(_run, argv)


if __name__ == "__main__":
  sys.exit(main())
