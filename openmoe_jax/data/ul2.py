"""UL2 for a decoder-only model: span corruption, prefix LM, mixture of denoisers.

Each denoiser turns tokenized documents ({"targets": tokens}) into examples
{"inputs": [mode] + corrupted text, "targets": what the model must produce + EOS};
seqio's `PrefixLMFeatureConverter` then concatenates them, puts the loss on the
targets only and marks the inputs prefix in `decoder_causal_attention`.

- Span corruption (T5): a random noise mask with `noise_density` r and
  `mean_span` mu (spans alternate non-noise / noise, starting with non-noise);
  each noise span becomes one sentinel `<extra_id_i>` in the inputs
  (i = 0, 1, ... left to right); the targets are the noise spans, each after
  its sentinel (the non-noise spans become the sentinels there).
- Prefix LM: the document is cut at a random point, inputs before, targets after.

Documents are cut into pieces of the longest raw length whose examples fit
`sequence_length["inputs"]` / `["targets"]` (and whose spans fit the
vocabulary's sentinels), so nothing is trimmed away. OpenMoE's mixture
(`OPENMOE_DENOISERS`) is registered as one seqio Task per denoiser, mixed by
rate (tasks/__init__.py), as t5's `ul2_objective` samples its denoiser streams.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Optional, Sequence

import gin
import numpy as np
import seqio
import tensorflow as tf

from openmoe_jax.data import vocabulary as vocab_lib


@dataclasses.dataclass(frozen=True)
class Denoiser:
  """One UL2 denoiser. `mean_span` None means prefix LM; `mode` a mode token."""

  name: str
  rate: float
  noise_density: float
  mean_span: Optional[float] = None
  mode: Optional[str] = None

  def __post_init__(self):
    if not 0.0 < self.noise_density < 1.0 or self.rate < 0:
      raise ValueError(f"{self}: need 0 < noise_density < 1 and rate >= 0")
    mu = self.mean_span
    # Beyond r = mu / (mu + 1) T5's mask has more noise spans than gaps.
    if mu is not None and not (mu >= 1 and self.noise_density <= mu / (mu + 1)):
      raise ValueError(f"{self}: need mean_span >= 1, noise_density <= "
                       "mean_span / (mean_span + 1)")

  @property
  def is_prefix_lm(self) -> bool:
    return self.mean_span is None


# OpenMoE's UL2 (fork of t5's ul2_objective): 50% prefix LM, 10% each span
# corruption; [NLU] short spans, [NLG] long or dense ones, [S2S] prefix LM.
OPENMOE_DENOISERS = (
    Denoiser("prefix_lm", 0.5, 0.5, None, "[S2S]"),
    Denoiser("span3_r15", 0.1, 0.15, 3.0, "[NLU]"),
    Denoiser("span8_r15", 0.1, 0.15, 8.0, "[NLU]"),
    Denoiser("span3_r50", 0.1, 0.5, 3.0, "[NLG]"),
    Denoiser("span8_r50", 0.1, 0.5, 8.0, "[NLG]"),
    Denoiser("span64_r50", 0.1, 0.5, 64.0, "[NLG]"),
)


@gin.configurable
def ul2_denoisers(
    denoisers: Sequence[tuple] = tuple(dataclasses.astuple(d)
                                       for d in OPENMOE_DENOISERS),
) -> tuple[Denoiser, ...]:
  """Returns the denoisers of the UL2 tasks (default: OpenMoE's six).

  gin: a list of (name, rate, noise_density, mean_span or None, mode or None).
  """
  return tuple(d if isinstance(d, Denoiser) else Denoiser(*d) for d in denoisers)


def mode_ids(vocab: seqio.Vocabulary, mode: Optional[str]) -> list[int]:
  """Returns the ids of a mode prefix: one piece if the vocabulary has it, else
  the text "[NLU] " encoded as OpenMoE wrote it; [] for no mode."""
  if mode is None:
    return []
  try:
    return [vocab_lib.mode_token_id(vocab, mode)]
  except ValueError:
    return list(vocab.encode(mode + " "))


# ----------------------------------------------------------------- counting


def span_counts(length: int, noise_density: float,
                mean_span: float) -> tuple[int, int]:
  """Returns (noise tokens, noise spans) of T5's mask for `length` tokens.

  As t5's `random_spans_noise_mask` (t5/data/preprocessors.py) computes them:
  float32 products and quotients, rounded half to even; noise tokens clamped to
  [1, length - 1], spans at least 1. Float64 would differ for some lengths
  (190 x 0.15 is 28.499... in float64 but 28.500002 in float32: T5 masks 29).
  """
  f32 = np.float32
  noise = int(np.round(f32(length) * f32(noise_density)))
  noise = min(max(noise, 1), length - 1)
  return noise, max(int(np.round(f32(noise) / f32(mean_span))), 1)


def example_lengths(d: Denoiser, length: int, mode_len: int) -> tuple[int, int]:
  """Returns the largest (inputs, targets) lengths `d` makes from `length` tokens."""
  if d.is_prefix_lm:
    return mode_len + length - 1, length  # at least one token on each side
  noise, spans = span_counts(length, d.noise_density, d.mean_span)
  return mode_len + length - noise + spans, noise + spans + 1


def piece_length(d: Denoiser, sequence_length: Mapping[str, int],
                 mode_len: int, max_sentinels: int) -> int:
  """Returns the longest raw piece whose example fits `sequence_length`.

  Lengths grow monotonically with the piece, so the first misfit ends the scan.
  """
  best = 0
  for length in range(2, int(sequence_length["inputs"]) +
                      int(sequence_length["targets"]) + 1):
    inputs, targets = example_lengths(d, length, mode_len)
    spans = 0 if d.is_prefix_lm else span_counts(
        length, d.noise_density, d.mean_span)[1]
    if (inputs > sequence_length["inputs"] or
        targets > sequence_length["targets"] or spans > max_sentinels):
      break
    best = length
  if best < 2:
    raise ValueError(f"sequence_length {dict(sequence_length)} too short for {d}")
  return best


# -------------------------------------------------------------- noise masks


def _random_segmentation(num_items, num_segments, seed):
  """Returns [num_segments] positive lengths summing to num_items, at random."""
  first = tf.range(num_items - 1) < num_segments - 1
  first = tf.random.experimental.stateless_shuffle(first, seed=seed)
  first = tf.pad(tf.cast(first, tf.int32), [[1, 0]])
  segment_id = tf.cumsum(first)
  return tf.math.unsorted_segment_sum(tf.ones_like(segment_id), segment_id,
                                      num_segments)


def random_spans_noise_mask(length, noise_density: float, mean_span: float,
                            seeds) -> tf.Tensor:
  """Returns a bool [length] mask (True = noise) of T5's random spans.

  Alternating non-noise / noise spans, starting with non-noise; the counts are
  `span_counts(length, ...)`. `seeds`: [2, 2] int32 stateless seeds.
  """
  length = tf.cast(length, tf.int32)
  as_f32 = lambda x: tf.cast(x, tf.float32)  # T5's precision: see span_counts
  noise = tf.cast(tf.math.round(as_f32(length) * noise_density), tf.int32)
  noise = tf.clip_by_value(noise, 1, length - 1)
  spans = tf.cast(tf.math.round(as_f32(noise) / mean_span), tf.int32)
  spans = tf.maximum(spans, 1)
  noise_lengths = _random_segmentation(noise, spans, seeds[0])
  keep_lengths = _random_segmentation(length - noise, spans, seeds[1])
  interleaved = tf.reshape(tf.stack([keep_lengths, noise_lengths], 1), [-1])
  starts = tf.cumsum(interleaved)[:-1]
  start_flags = tf.math.unsorted_segment_sum(tf.ones_like(starts), starts, length)
  return tf.equal(tf.cumsum(start_flags) % 2, 1)


def spans_to_sentinels(tokens: tf.Tensor, mask: tf.Tensor,
                       vocab_size: int) -> tf.Tensor:
  """Returns `tokens` with each masked span replaced by one sentinel.

  The i-th masked span (from 0) becomes `<extra_id_i>` = vocab_size - 1 - i.
  """
  previous = tf.pad(mask[:-1], [[1, 0]])
  first = mask & ~previous
  sentinels = vocab_size - tf.cumsum(tf.cast(first, tokens.dtype))
  tokens = tf.where(first, sentinels, tokens)
  return tf.boolean_mask(tokens, ~(mask & previous))


def random_prefix_split(length, noise_density: float, seed) -> tf.Tensor:
  """Returns the number of inputs tokens of a prefix LM example, in [1, length-1].

  Uniform over [round((1 - 2r)(length - 1)), length - 1] (at least 1), so the
  expected target share is about r for r <= 0.5 (t5's random_prefix_noise_mask).
  """
  top = tf.cast(length, tf.int32) - 1
  low = tf.cast(tf.math.round((1.0 - 2.0 * min(noise_density, 0.5)) *
                              tf.cast(top, tf.float64)), tf.int32)
  low = tf.clip_by_value(low, 1, top)
  return tf.random.stateless_uniform([], seed, minval=low, maxval=top + 1,
                                     dtype=tf.int32)


# ------------------------------------------------------------ preprocessors


def split_pieces(dataset: tf.data.Dataset, length: int) -> tf.data.Dataset:
  """Returns {"targets"} pieces of at most `length` tokens (2 or more)."""

  def pieces(ex):
    tokens = ex["targets"]
    starts = tf.range(0, tf.size(tokens, out_type=tf.int64), length)
    return {"targets": tf.RaggedTensor.from_row_starts(tokens, starts)}

  dataset = dataset.map(pieces, num_parallel_calls=tf.data.AUTOTUNE).unbatch()
  return dataset.filter(lambda ex: tf.size(ex["targets"]) >= 2)


def denoise(dataset: tf.data.Dataset, sequence_length: Mapping[str, int],
            output_features: Mapping[str, seqio.Feature],
            denoiser: Denoiser) -> tf.data.Dataset:
  """Returns {"inputs", "targets"} examples made by `denoiser` from tokens.

  inputs = mode ids + (text with spans -> sentinels | text before the split);
  targets = (sentinel + span, ... | text after the split) + EOS. Both fit
  `sequence_length` ("inputs", "targets") without trimming.
  """
  vocab = output_features["targets"].vocabulary
  mode = tf.constant(mode_ids(vocab, denoiser.mode), tf.int32)
  length = piece_length(denoiser, sequence_length, len(mode_ids(
      vocab, denoiser.mode)), vocab.extra_ids)
  eos = tf.constant([vocab.eos_id], tf.int32)

  @seqio.map_over_dataset(num_seeds=2)
  def corrupt(ex, seeds):
    tokens = tf.cast(ex["targets"], tf.int32)
    if denoiser.is_prefix_lm:
      split = random_prefix_split(tf.size(tokens), denoiser.noise_density,
                                  seeds[0])
      inputs, targets = tokens[:split], tokens[split:]
    else:
      noise = random_spans_noise_mask(tf.size(tokens), denoiser.noise_density,
                                      denoiser.mean_span, seeds)
      inputs = spans_to_sentinels(tokens, noise, vocab.vocab_size)
      targets = spans_to_sentinels(tokens, ~noise, vocab.vocab_size)
    return {"inputs": tf.concat([mode, inputs], 0),
            "targets": tf.concat([targets, eos], 0)}

  return corrupt(split_pieces(dataset, length))


def denoiser_preprocessor(denoiser: Denoiser):
  """Returns a seqio preprocessor applying `denoiser` (see `denoise`)."""
  return functools.partial(denoise, denoiser=denoiser)


def output_features(vocab: seqio.Vocabulary) -> dict[str, seqio.Feature]:
  """Returns the UL2 task features: inputs (no EOS added) and targets (EOS)."""
  return {"inputs": seqio.Feature(vocabulary=vocab, add_eos=False),
          "targets": seqio.Feature(vocabulary=vocab, add_eos=True)}
