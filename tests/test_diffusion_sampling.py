"""Masked diffusion sampling (decoding/diffusion.py): the transfer schedule, Gumbel
sampling, blocks filled left to right, and low-confidence remasking against a NumPy
copy of LLaDA's generate()."""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffusion_stubs import MASK, V, stub_params, tiny_model
from openmoe_jax.decoding.diffusion import (gumbel_argmax, sample_diffusion,
                                            transfer_schedule)


@pytest.fixture(scope="module")
def tiny():
  return tiny_model()


def test_transfer_schedule_spreads_tokens_evenly():
  count_s, end_s = transfer_schedule(gen_length=8, steps=6, block_length=4)
  assert list(count_s) == [2, 1, 1, 2, 1, 1] and list(end_s) == [4, 4, 4, 8, 8, 8]
  with pytest.raises(ValueError, match="steps 3 must be a multiple of the number of "
                     "blocks 2"):
    transfer_schedule(gen_length=8, steps=3, block_length=4)
  with pytest.raises(ValueError, match="gen_length 8 must be a multiple of block_length 3"):
    transfer_schedule(gen_length=8, steps=8, block_length=3)
  with pytest.raises(ValueError, match="5 steps per block exceed block_length 4"):
    transfer_schedule(gen_length=8, steps=10, block_length=4)
  for bad in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
    with pytest.raises(ValueError, match="must be >= 1"):
      transfer_schedule(*bad)
  # One token a step at the most: 4 steps fill a block of 4, one token each.
  assert list(transfer_schedule(4, 4, 4)[0]) == [1, 1, 1, 1]
  # Blocks of one token: left to right, one a step (autoregressive order).
  count_s, end_s = transfer_schedule(2, 2, 1)
  assert list(count_s) == [1, 1] and list(end_s) == [1, 2]
  # The smallest answer, and one step that commits a whole answer at once.
  assert [list(a) for a in transfer_schedule(1, 1, 1)] == [[1], [1]]
  assert [list(a) for a in transfer_schedule(4, 1, 4)] == [[4], [4]]
  with pytest.raises(ValueError, match=r"remasking='confident'; choose one of"):
    sample_diffusion(None, None, [1, 2], gen_length=4, steps=4, remasking="confident",
                     mask_id=0)


def test_gumbel_sampling_matches_softmax():
  logits_v = jnp.log(jnp.asarray([0.6, 0.3, 0.1]))
  logits_btv = jnp.broadcast_to(logits_v, (1, 30000, 3))
  tokens = np.asarray(gumbel_argmax(jax.random.PRNGKey(0), logits_btv, 1.0))
  np.testing.assert_allclose(np.bincount(tokens[0], minlength=3) / 30000,
                             [0.6, 0.3, 0.1], atol=0.01)
  # Temperature 0.5 samples softmax(logits / 0.5), proportional to p^2.
  tokens = np.asarray(gumbel_argmax(jax.random.PRNGKey(1), logits_btv, 0.5))
  np.testing.assert_allclose(np.bincount(tokens[0], minlength=3) / 30000,
                             np.asarray([0.36, 0.09, 0.01]) / 0.46, atol=0.01)
  assert (np.asarray(gumbel_argmax(None, logits_btv, 0.0)) == 0).all()


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_sampler_fills_blocks_left_to_right_on_schedule(tiny, remasking):
  model, params = tiny
  prompt = np.asarray([[9, 10, 11, MASK], [12, 13, 14, 15]])
  kwargs = dict(gen_length=8, steps=6, block_length=4, remasking=remasking,
                mask_id=MASK, vocab_limit=60)
  out, hist = sample_diffusion(model, params, prompt, rng=jax.random.PRNGKey(0),
                               temperature=1.0, return_history=True, **kwargs)
  np.testing.assert_array_equal(out[:, :4], prompt)
  assert not (out[:, 4:] == MASK).any() and (out < 60).all()
  count_s, end_s = transfer_schedule(8, 6, 4)
  masks_s = (hist[:, :, 4:] == MASK).sum(-1)
  np.testing.assert_array_equal(masks_s, (8 - np.cumsum(count_s))[:, None].repeat(2, 1))
  for s, end in enumerate(end_s):
    assert (hist[s, :, 4 + end:] == MASK).all()
  again = sample_diffusion(model, params, prompt, rng=jax.random.PRNGKey(0),
                           temperature=1.0, **kwargs)
  np.testing.assert_array_equal(out, again)


class KnownConfidence(nn.Module):
  """Stub decoder: position (b, t) predicts answer[b][t] with logit scale[b][t] (0
  elsewhere), whatever the input, so its confidences are known in advance."""

  answer: Any = None  # tuples of tuples: the sampler caches by model (hashable)
  scale: Any = None

  @nn.compact
  def __call__(self, tokens_bt, **kwargs):
    bias_v = self.param("bias", nn.initializers.zeros, (V,))
    logits_btv = (jnp.asarray(self.scale)[..., None] * jax.nn.one_hot(
        jnp.asarray(self.answer), V) + bias_v)
    zero = jnp.zeros((), jnp.float32)
    return logits_btv, {"aux_loss": zero, "lb_loss": zero, "z_loss": zero}


def _llada_low_confidence(prompt_bp, logits_btv, gen_length, steps, block_length):
  """NumPy LLaDA generate() at temperature 0 with low_confidence remasking for logits
  that do not depend on the input: returns the positions committed at each step."""
  b, p = prompt_bp.shape
  x_bt = np.concatenate([prompt_bp, np.full((b, gen_length), MASK)], 1)
  z_btv = logits_btv - logits_btv.max(-1, keepdims=True)
  probs_btv = np.exp(z_btv) / np.exp(z_btv).sum(-1, keepdims=True)
  x0_bt = probs_btv.argmax(-1)
  x0_p_bt = probs_btv.max(-1)
  per_block = steps // (gen_length // block_length)
  committed = []
  for block in range(gen_length // block_length):
    end = p + (block + 1) * block_length
    mask_num_b = (x_bt[:, end - block_length:end] == MASK).sum(1)
    num_transfer_bs = np.repeat((mask_num_b // per_block)[:, None], per_block, 1)
    for i in range(per_block):  # get_num_transfer_tokens: remainder on the first steps
      num_transfer_bs[:, i] += i < mask_num_b % per_block
    for i in range(per_block):
      confidence_bt = np.where(x_bt == MASK, x0_p_bt, -np.inf)
      confidence_bt[:, end:] = -np.inf
      step = []
      for r in range(b):
        top = np.argsort(-confidence_bt[r], kind="stable")[:num_transfer_bs[r, i]]
        x_bt[r, top] = x0_bt[r, top]
        step.append(sorted(top.tolist()))
      committed.append(step)
  return committed, x_bt


def test_low_confidence_remasking_commits_the_most_confident_masked_tokens():
  b, p, gen_length, steps, block_length = 2, 3, 10, 4, 5  # 3 + 2 tokens per block
  t = p + gen_length
  rng = np.random.default_rng(0)
  scale_bt = np.stack([rng.permutation(np.linspace(1.0, 6.0, t)) for _ in range(b)])
  answer_bt = rng.integers(7, 60, (b, t))
  model = KnownConfidence(answer=tuple(map(tuple, answer_bt.tolist())),
                          scale=tuple(map(tuple, scale_bt.tolist())))
  prompt_bp = np.asarray([[9, 10, 11], [12, 13, 14]])
  out, hist = sample_diffusion(model, stub_params(model), prompt_bp, gen_length=gen_length,
                               steps=steps, block_length=block_length, mask_id=MASK,
                               return_history=True)
  logits_btv = scale_bt[..., None] * np.eye(V)[answer_bt]
  expected, expected_out = _llada_low_confidence(prompt_bp, logits_btv, gen_length,
                                                 steps, block_length)
  before_sbt = np.concatenate([np.concatenate(
      [prompt_bp, np.full((b, gen_length), MASK)], 1)[None], hist[:-1]])
  got = [[np.flatnonzero((before_sbt[s, r] == MASK) & (hist[s, r] != MASK)).tolist()
          for r in range(b)] for s in range(steps)]
  assert got == expected
  assert [len(c) for c in got[0]] == [3, 3] and [len(c) for c in got[1]] == [2, 2]
  np.testing.assert_array_equal(out, expected_out)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_mask_and_ids_from_the_vocab_limit_on_are_never_sampled(temperature):
  """The model's best guess is the mask id, the vocab limit itself or an id above it
  (logit 50): the sampler takes id 2, the only other likely one (logit 1 against -100
  for the rest), at any temperature."""
  limit, gen_length = 40, 6
  answer = [MASK, limit, V - 1] * 3
  model = KnownConfidence(answer=(tuple(answer),), scale=((50.0,) * 9,))
  banned = jnp.asarray([MASK, limit, V - 1])
  params = {"bias": jnp.full((V,), -100.0).at[2].set(1.0).at[banned].set(0.0)}
  out = sample_diffusion(model, params, [9, 10, 11], gen_length=gen_length,
                         steps=gen_length, mask_id=MASK, vocab_limit=limit,
                         temperature=temperature, rng=jax.random.PRNGKey(0))
  assert out[0, 3:].tolist() == [2] * gen_length, out


def test_greedy_low_confidence_sampling_ignores_the_seed(tiny):
  model, params = tiny
  run = lambda seed: sample_diffusion(
      model, params, [9, 10, 11], gen_length=8, steps=8, block_length=8,
      temperature=0.0, rng=jax.random.PRNGKey(seed), mask_id=MASK)
  np.testing.assert_array_equal(run(0), run(1))
