"""Masked diffusion LM sampling: LLaDA-style iterative unmasking.

The answer starts as `gen_length` mask tokens after the prompt. It is cut into blocks
of `block_length` filled left to right (semi-autoregressive; one block = plain
diffusion). Each step predicts every masked position of the current block, commits
the most confident predictions (`low_confidence` remasking: the rest are re-masked)
or a random subset (`random`), so that each block is done after steps/num_blocks
steps with the same number of tokens committed per step (+1 on the first steps when
it does not divide). The whole loop is one jitted `lax.scan` over steps.
"""
import functools
from typing import Any, Optional, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

REMASKING = ("low_confidence", "random")


def transfer_schedule(gen_length: int, steps: int, block_length: int
                      ) -> Tuple[np.ndarray, np.ndarray]:
  """Returns (count_s, block_end_s) int32 [steps]: tokens committed at each step and
  the end (exclusive, relative to the answer start) of that step's block."""
  if gen_length < 1 or steps < 1 or block_length < 1:
    raise ValueError("gen_length, steps and block_length must be >= 1")
  if gen_length % block_length:
    raise ValueError(f"gen_length {gen_length} must be a multiple of "
                     f"block_length {block_length}")
  num_blocks = gen_length // block_length
  if steps % num_blocks:
    raise ValueError(f"steps {steps} must be a multiple of the number of blocks "
                     f"{num_blocks}")
  per_block = steps // num_blocks
  if per_block > block_length:
    raise ValueError(f"{per_block} steps per block exceed block_length {block_length}")
  base, extra = divmod(block_length, per_block)
  count_k = np.full(per_block, base, np.int32)
  count_k[:extra] += 1
  count_s = np.tile(count_k, num_blocks)
  block_end_s = np.repeat(np.arange(1, num_blocks + 1, dtype=np.int32) * block_length,
                          per_block)
  return count_s, block_end_s


def gumbel_argmax(rng: jax.Array, logits_btv: jax.Array, temperature: float) -> jax.Array:
  """Returns tokens_bt sampled from softmax(logits / temperature) (argmax at 0).

  Gumbel-max in log space and float32: argmax(logits / T + g). LLaDA's form
  exp(logits) / (-log u)^T needs float64 to avoid overflow; this one does not.
  """
  logits_btv = logits_btv.astype(jnp.float32)
  if temperature <= 0:
    return jnp.argmax(logits_btv, axis=-1).astype(jnp.int32)
  g_btv = jax.random.gumbel(rng, logits_btv.shape, jnp.float32)
  return jnp.argmax(logits_btv / temperature + g_btv, axis=-1).astype(jnp.int32)


def _step(model, remasking, temperature, mask_id, vocab_limit, prompt_length,
          params, x_bt, count, block_end, rng):
  """Returns x_bt with `count` more masked answer positions of the current block
  (those before prompt_length + block_end) committed in every row."""
  logits_btv, _ = model.apply({"params": params}, x_bt, attention_kind="bidirectional",
                              train=False)
  vocab_v = jnp.arange(logits_btv.shape[-1])
  banned_v = vocab_v == mask_id
  if vocab_limit is not None:
    banned_v = banned_v | (vocab_v >= vocab_limit)
  logits_btv = jnp.where(banned_v, -jnp.inf, logits_btv.astype(jnp.float32))
  noise_rng, pick_rng = jax.random.split(rng)
  x0_bt = gumbel_argmax(noise_rng, logits_btv, temperature)
  if remasking == "low_confidence":
    logp_btv = jax.nn.log_softmax(logits_btv, axis=-1)
    conf_bt = jnp.take_along_axis(logp_btv, x0_bt[..., None], axis=-1)[..., 0]
  else:
    conf_bt = jax.random.uniform(pick_rng, x_bt.shape)
  pos_t = jnp.arange(x_bt.shape[1])
  open_t = (pos_t >= prompt_length) & (pos_t < prompt_length + block_end)
  eligible_bt = (x_bt == mask_id) & open_t[None]
  conf_bt = jnp.where(eligible_bt, conf_bt, -jnp.inf)
  rank_bt = jnp.argsort(jnp.argsort(-conf_bt, axis=-1), axis=-1)
  commit_bt = eligible_bt & (rank_bt < count)
  return jnp.where(commit_bt, x0_bt, x_bt)


@functools.lru_cache(maxsize=32)
def _compiled(model, remasking, temperature, mask_id, vocab_limit, prompt_length):
  """Returns a jitted (params, x_bt, count_s, block_end_s, rng_s) -> states [s, b, t]."""
  step = functools.partial(_step, model, remasking, temperature, mask_id, vocab_limit,
                           prompt_length)

  def run(params, x_bt, count_s, block_end_s, rng_s):
    def body(x, xs):
      x = step(params, x, *xs)
      return x, x
    _, states_sbt = jax.lax.scan(body, x_bt, (count_s, block_end_s, rng_s))
    return states_sbt
  return jax.jit(run)


def sample_diffusion(model: nn.Module, params: Any, prompt_ids, *, gen_length: int,
                     steps: int, block_length: Optional[int] = None,
                     remasking: str = "low_confidence", temperature: float = 0.0,
                     rng: Optional[jax.Array] = None, mask_id: int,
                     vocab_limit: Optional[int] = None, return_history: bool = False
                     ) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
  """Generates `gen_length` tokens after each prompt row by iterative unmasking.

  prompt_ids: [p] or [b, p] ints (rows of equal length). block_length None: one block.
  vocab_limit: ids >= it (padded embedding rows) are never sampled; nor is mask_id.
  Returns the int32 sequences [b, p + gen_length] (prompt included); with
  `return_history`, also the state after every step [steps, b, p + gen_length].
  """
  if remasking not in REMASKING:
    raise ValueError(f"remasking={remasking!r}; choose one of {REMASKING}")
  prompt_bp = np.asarray(prompt_ids, np.int32)
  if prompt_bp.ndim == 1:
    prompt_bp = prompt_bp[None]
  count_s, block_end_s = transfer_schedule(gen_length, steps, block_length or gen_length)
  b, p = prompt_bp.shape
  x_bt = np.concatenate([prompt_bp, np.full((b, gen_length), mask_id, np.int32)], 1)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  run = _compiled(model, remasking, float(temperature), int(mask_id), vocab_limit, p)
  states_sbt = np.asarray(jax.device_get(run(
      params, jnp.asarray(x_bt), jnp.asarray(count_s), jnp.asarray(block_end_s),
      jax.random.split(rng, steps))))
  if return_history:
    return states_sbt[-1], states_sbt
  return states_sbt[-1]
