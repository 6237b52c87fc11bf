"""Tests for UL2: span corruption, prefix LM, the denoiser mixture, batches.

The tiny UL2 training run is in test_ul2_train.py.
"""

import gin
import jax.numpy as jnp
import numpy as np
import pytest
import seqio
import tensorflow as tf

from openmoe_jax.data import pipeline
from openmoe_jax.data import ul2
from openmoe_jax.data import vocabulary as vocab_lib
from openmoe_jax.layers.attention import make_attention_mask

LENGTHS = {"inputs": 128, "targets": 128}
DENOISERS = {d.name: d for d in ul2.OPENMOE_DENOISERS}


@pytest.fixture(scope="module")
def vocab():
  return vocab_lib.get_vocabulary()


def _documents(piece, n_docs=24, seed=0):
  """Returns random documents of whole pieces plus a tail (ids below sentinels)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(10, 8000, size=piece * rng.integers(1, 6) + 7,
                       dtype=np.int32) for _ in range(n_docs)]


def _denoise(vocab, denoiser, docs, lengths=LENGTHS):
  ds = tf.data.Dataset.from_generator(
      lambda: ({"targets": d} for d in docs),
      output_signature={"targets": tf.TensorSpec([None], tf.int32)})
  with seqio.map_seed_manager(1):
    out = ul2.denoise(ds, lengths, ul2.output_features(vocab), denoiser)
  return list(out.as_numpy_iterator())


def _reconstruct(vocab, ex):
  """Returns (original tokens, noise span lengths) from a span-corruption example."""
  first_sentinel = vocab.vocab_size - vocab.extra_ids
  inputs, targets = ex["inputs"][1:].tolist(), ex["targets"].tolist()
  assert targets[-1] == vocab.eos_id
  targets = targets[:-1]
  spans, current = {}, None
  for t in targets:
    if t >= first_sentinel:
      current = t
      spans[current] = []
    else:
      spans[current].append(t)
  sentinels_in = [t for t in inputs if t >= first_sentinel]
  expected = [vocab_lib.sentinel_id(vocab, i) for i in range(len(sentinels_in))]
  assert sentinels_in == expected
  assert list(spans) == expected  # T5's masks always end with a noise span
  out = []
  for t in inputs:
    out.extend(spans[t] if t >= first_sentinel else [t])
  return out, [len(spans[s]) for s in sentinels_in]


@pytest.mark.parametrize("name", [n for n in DENOISERS if n != "prefix_lm"])
def test_span_corruption_statistics_and_reconstruction(vocab, name):
  d = DENOISERS[name]
  lengths = {"inputs": 512, "targets": 512}
  piece = ul2.piece_length(d, lengths, 1, vocab.extra_ids)
  docs = _documents(piece)
  examples = _denoise(vocab, d, docs, lengths)
  mode = vocab_lib.mode_token_id(vocab, d.mode)
  rebuilt, full_spans, all_spans = [], [], []
  for ex in examples:
    assert ex["inputs"][0] == mode
    assert len(ex["inputs"]) <= lengths["inputs"]
    assert len(ex["targets"]) <= lengths["targets"]
    tokens, spans = _reconstruct(vocab, ex)
    rebuilt.extend(tokens)
    all_spans.extend(spans)
    if len(tokens) == piece:  # document tails are shorter pieces
      full_spans.extend(spans)
      # The lengths the pieces were cut by are the examples' real lengths.
      assert (sum(spans), len(spans)) == ul2.span_counts(piece, d.noise_density,
                                                         d.mean_span)
      assert (len(ex["inputs"]), len(ex["targets"])) == ul2.example_lengths(d, piece, 1)
  np.testing.assert_array_equal(rebuilt, np.concatenate(docs))
  n_full = len(examples) - len(docs)
  density = sum(full_spans) / (n_full * piece)
  mean_span = float(np.mean(full_spans))
  print(f"{name}: piece {piece}, {n_full} full pieces: density {density:.4f} "
        f"(want {d.noise_density}), mean span {mean_span:.2f} (want "
        f"{d.mean_span}), span lengths {min(full_spans)}..{max(full_spans)}; "
        f"with tails: density {sum(all_spans) / len(rebuilt):.4f}, "
        f"mean span {np.mean(all_spans):.2f}")
  assert abs(density - d.noise_density) < 0.01
  assert abs(mean_span / d.mean_span - 1) < 0.1
  assert min(full_spans) >= 1
  if d.mean_span <= 8:  # spans vary in length, not all equal
    assert len(set(full_spans)) > 3


# (noise density, mean span) of the span-corruption denoisers in OpenMoE's mixture,
# plus (0.15, 64) to cover a long span at low density and (0.9, 64), where T5's
# clamp of the noise to length - 1 binds (lengths 2, 3 and 4).
SPAN_PAIRS = ((0.15, 3.0), (0.15, 8.0), (0.5, 3.0), (0.5, 8.0), (0.5, 64.0),
              (0.15, 64.0), (0.9, 64.0))


def _t5_span_counts_n(lengths_n, noise_density, mean_span):
  """Returns T5's (noise tokens [n], noise spans [n]) for each length, written from
  t5/data/preprocessors.py random_spans_noise_mask: float32 math, tf.round (half to
  even), noise clamped to [1, length - 1], spans at least 1."""
  f32 = np.float32
  noise_n = np.round(lengths_n.astype(f32) * f32(noise_density)).astype(np.int32)
  noise_n = np.minimum(np.maximum(noise_n, 1), lengths_n - 1)
  spans_n = np.round(noise_n.astype(f32) / f32(mean_span)).astype(np.int32)
  return noise_n, np.maximum(spans_n, 1)


def test_span_pairs_cover_the_openmoe_mixture():
  pairs = {(d.noise_density, d.mean_span) for d in ul2.OPENMOE_DENOISERS
           if not d.is_prefix_lm}
  assert pairs <= set(SPAN_PAIRS)


@pytest.mark.parametrize("noise_density,mean_span", SPAN_PAIRS)
def test_span_counts_equal_t5_for_every_length(noise_density, mean_span):
  lengths_n = np.arange(2, 4097, dtype=np.int32)
  want_noise_n, want_spans_n = _t5_span_counts_n(lengths_n, noise_density, mean_span)
  got = np.array([ul2.span_counts(int(n), noise_density, mean_span)
                  for n in lengths_n])
  np.testing.assert_array_equal(got[:, 0], want_noise_n)
  np.testing.assert_array_equal(got[:, 1], want_spans_n)


def test_span_counts_at_length_190():
  # 190 x 0.15 is 28.4999... in float64 but 28.500002 in float32: T5 masks 29
  # tokens in round(29 / 3) = 10 spans, not 28 in 9.
  assert ul2.span_counts(190, 0.15, 3.0) == (29, 10)
  assert ul2.span_counts(190, 0.15, 8.0) == (29, 4)


@pytest.mark.parametrize("noise_density,mean_span", SPAN_PAIRS)
def test_noise_mask_counts_equal_t5(noise_density, mean_span):
  # The first lengths where float32 and float64 rounding differ at density 0.15
  # (190 ... 1310), plus a spread; the graph is traced once for all lengths.
  lengths_n = np.array([2, 3, 5, 17, 190, 350, 390, 670, 1310, 2047, 4096], np.int32)
  want_noise_n, want_spans_n = _t5_span_counts_n(lengths_n, noise_density, mean_span)
  mask_fn = tf.function(lambda n: ul2.random_spans_noise_mask(
      n, noise_density, mean_span, tf.constant([[1, 2], [3, 4]])))
  for n, want_noise, want_spans in zip(lengths_n, want_noise_n, want_spans_n):
    mask = mask_fn(tf.constant(n)).numpy()
    starts = mask & ~np.pad(mask[:-1], [1, 0])
    assert (mask.size, mask.sum(), starts.sum()) == (n, want_noise, want_spans)


def test_piece_length_fits_and_respects_sentinels(vocab):
  for d in ul2.OPENMOE_DENOISERS:
    for lengths in (LENGTHS, {"inputs": 1024, "targets": 1024}):
      n = ul2.piece_length(d, lengths, 1, vocab.extra_ids)
      inputs, targets = ul2.example_lengths(d, n, 1)
      assert inputs <= lengths["inputs"] and targets <= lengths["targets"]
      grown = ul2.example_lengths(d, n + 1, 1)
      spans = 0 if d.is_prefix_lm else ul2.span_counts(
          n + 1, d.noise_density, d.mean_span)[1]
      assert (grown[0] > lengths["inputs"] or grown[1] > lengths["targets"]
              or spans > vocab.extra_ids)
  # 1024 inputs at (3, .5) would need ~256 sentinels; the vocab has 100.
  n = ul2.piece_length(DENOISERS["span3_r50"], {"inputs": 1024, "targets": 1024},
                       1, vocab.extra_ids)
  assert ul2.span_counts(n, 0.5, 3.0)[1] == 100


def test_prefix_lm_split(vocab):
  d = DENOISERS["prefix_lm"]
  piece = ul2.piece_length(d, LENGTHS, 1, vocab.extra_ids)
  assert piece == 128
  docs = _documents(piece, n_docs=60)
  examples = _denoise(vocab, d, docs)
  s2s = vocab_lib.mode_token_id(vocab, "[S2S]")
  rebuilt, shares = [], []
  for ex in examples:
    assert ex["inputs"][0] == s2s and ex["targets"][-1] == vocab.eos_id
    inputs, targets = ex["inputs"][1:], ex["targets"][:-1]
    assert len(inputs) >= 1 and len(targets) >= 1
    rebuilt.extend(inputs.tolist() + targets.tolist())
    if len(inputs) + len(targets) == piece:
      shares.append(len(targets) / piece)
  np.testing.assert_array_equal(rebuilt, np.concatenate(docs))
  print(f"prefix_lm: {len(shares)} full pieces, target share {np.mean(shares):.3f}")
  assert abs(np.mean(shares) - 0.5) < 0.06
  assert min(shares) < 0.15 and max(shares) > 0.85  # split point is uniform


def test_prefix_split_below_half_density_follows_t5():
  """t5's random_prefix_noise_mask: inputs uniform over [round((1 - 2r)(n - 1)),
  n - 1] (at least 1). At r = 0.25 and n = 101 that is [50, 100], mean target
  share about r; at OpenMoE's r = 0.5 the lower end is 1."""
  split = tf.function(lambda n, r, seed: ul2.random_prefix_split(n, r, seed),
                      reduce_retracing=True)
  draws = np.array([int(split(101, 0.25, tf.constant([s, 7]))) for s in range(300)])
  assert draws.min() >= 50 and draws.max() <= 100
  assert draws.min() <= 52 and draws.max() >= 98  # spans the whole range
  assert abs(np.mean(101 - draws) / 101 - 0.25) < 0.03
  half = np.array([int(split(101, 0.5, tf.constant([s, 7]))) for s in range(300)])
  assert half.min() >= 1 and half.min() <= 5


def test_mixture_rates_and_realised_denoiser_shares(vocab):
  pipeline.tasks.register_tasks()
  mix = seqio.get_mixture_or_task("local_code_ul2")
  rates = {t.name[len("local_code_ul2_"):]: mix.get_rate(t) / mix.total_rate
           for t in mix.tasks}
  assert rates == pytest.approx({n: d.rate for n, d in DENOISERS.items()})
  modes = {vocab_lib.mode_token_id(vocab, m): m for m in vocab_lib.MODE_TOKENS}
  ds = mix.get_dataset(LENGTHS, split="train", shuffle=False, seed=5)
  first_sentinel = vocab.vocab_size - vocab.extra_ids
  counts = dict.fromkeys(DENOISERS, 0)
  n = 1500
  for ex in ds.take(n).as_numpy_iterator():
    mode = modes[int(ex["inputs"][0])]
    if mode == "[S2S]":
      counts["prefix_lm"] += 1
      continue
    spans = int((ex["inputs"] >= first_sentinel).sum())
    mean = (len(ex["targets"]) - 1 - 2 * spans) / spans
    short = mean < 5.5
    if mode == "[NLU]":
      counts["span3_r15" if short else "span8_r15"] += 1
    else:
      counts["span3_r50" if short else
             "span8_r50" if mean < 25 else "span64_r50"] += 1
  shares = {k: v / n for k, v in counts.items()}
  print("realised denoiser shares:", {k: round(v, 3) for k, v in shares.items()})
  for name, d in DENOISERS.items():
    assert abs(shares[name] - d.rate) < 0.035, (name, shares)


@pytest.mark.parametrize("pack", [True, False])
def test_prefix_lm_batches_weight_targets_and_mark_inputs(vocab, pack):
  batch = next(pipeline.get_dataset("local_text_ul2", 256, 4, pack=pack,
                                    shuffle=False))
  assert set(batch) == set(pipeline.BATCH_KEYS) | {pipeline.PREFIX_KEY}
  modes = {vocab_lib.mode_token_id(vocab, m) for m in vocab_lib.MODE_TOKENS}
  seg, prefix = batch["decoder_segment_ids"], batch[pipeline.PREFIX_KEY]
  weights, tgt = batch["decoder_loss_weights"], batch["decoder_target_tokens"]
  inp = batch["decoder_input_tokens"]
  for row in range(4):
    for s in np.unique(seg[row][seg[row] > 0]):
      idx = np.flatnonzero(seg[row] == s)
      p, w = prefix[row, idx], weights[row, idx]
      n_inputs = int(p.sum()) - 1  # seqio marks one position past the inputs
      assert n_inputs >= 2 and tgt[row, idx[0]] in modes
      np.testing.assert_array_equal(p, np.arange(len(idx)) <= n_inputs)
      np.testing.assert_array_equal(w, np.arange(len(idx)) >= n_inputs)
      assert tgt[row, idx[-1]] == vocab.eos_id
      assert inp[row, idx[n_inputs]] == tgt[row, idx[n_inputs - 1]]
  assert (weights[seg == 0] == 0).all() and (prefix[seg == 0] == 0).all()
  # Bidirectional switch: prefix tokens see each other, targets stay causal.
  mask = np.asarray(make_attention_mask(
      "prefix", 256, jnp.asarray(seg), jnp.asarray(prefix), batch=4))[:, 0]
  causal = np.asarray(make_attention_mask("causal", 256, jnp.asarray(seg),
                                          batch=4))[:, 0]
  both = prefix.astype(bool)[:, :, None] & prefix.astype(bool)[:, None, :]
  same = seg[:, :, None] == seg[:, None, :]
  np.testing.assert_array_equal(mask, causal | (both & same))
  assert (mask & ~causal).any()
  targets_rows = ~prefix.astype(bool)
  np.testing.assert_array_equal(mask[targets_rows], causal[targets_rows])


def test_feature_converter_choice_and_gin(vocab):
  del vocab
  pipeline.tasks.register_tasks()
  lm = seqio.get_mixture_or_task("local_mix")
  converter, lengths = pipeline.feature_converter(lm, 256, True)
  assert isinstance(converter, seqio.DecoderFeatureConverter)
  assert lengths == {"targets": 256}
  gin.bind_parameter("feature_converter.inputs_fraction", 0.75)
  converter, lengths = pipeline.feature_converter(
      seqio.get_mixture_or_task("local_mix_ul2"), 256, False)
  assert isinstance(converter, seqio.PrefixLMFeatureConverter)
  assert lengths == {"inputs": 192, "targets": 64}
  # The split's edges: one input token or one target token is a split; rounding to
  # none of either is refused by name.
  ul2_mix = seqio.get_mixture_or_task("local_mix_ul2")
  for fraction, inputs in ((1 / 256, 1), (255 / 256, 255)):
    assert pipeline.feature_converter(ul2_mix, 256, False, inputs_fraction=fraction)[
        1] == {"inputs": inputs, "targets": 256 - inputs}
  for fraction in (0.001, 0.999):
    with pytest.raises(ValueError, match="leaves no inputs or no targets"):
      pipeline.feature_converter(ul2_mix, 256, False, inputs_fraction=fraction)
  gin.bind_parameter("ul2_denoisers.denoisers",
                     [("prefix_lm", 1.0, 0.5, None, "[S2S]")])
  pipeline.tasks.register_tasks()
  assert [t.name for t in seqio.get_mixture_or_task("local_text_ul2").tasks] == [
      "local_text_ul2_prefix_lm"]


def test_denoiser_validation():
  with pytest.raises(ValueError):
    ul2.Denoiser("bad", 0.1, 0.9, 3.0)
  with pytest.raises(ValueError):
    ul2.Denoiser("bad", 0.1, 0.0)
  with pytest.raises(ValueError):
    ul2.Denoiser("bad", 0.1, 1.0)  # a prefix LM needs some inputs
  with pytest.raises(ValueError):
    ul2.Denoiser("bad", -0.1, 0.5)
  with pytest.raises(ValueError):
    ul2.Denoiser("bad", 0.1, 0.5, 0.5)  # spans of at least one token
  assert ul2.Denoiser("ok", 0.1, 0.75, 3.0).mean_span == 3.0
  # The edges are allowed: rate 0 (a denoiser switched off in gin), single-token
  # spans up to density 1 / 2 (as many noise spans as gaps between them).
  assert ul2.Denoiser("off", 0.0, 0.5).rate == 0.0
  assert ul2.Denoiser("ok", 0.1, 0.5, 1.0).mean_span == 1.0
  with pytest.raises(ValueError):
    ul2.Denoiser("bad", 0.1, 0.51, 1.0)


def test_prefix_lm_piece_fills_the_inputs_when_they_bind():
  # A prefix LM cuts a piece of n tokens with at least one on each side, so its
  # inputs hold at most the mode token + n - 1 tokens and its targets n - 1 + EOS:
  # 64 inputs take pieces of 64 tokens (63 + the mode token), 65 without a mode.
  d = DENOISERS["prefix_lm"]
  lengths = {"inputs": 64, "targets": 1024}
  assert ul2.piece_length(d, lengths, 1, 100) == 64
  assert ul2.piece_length(d, lengths, 0, 100) == 65
  assert ul2.example_lengths(d, 64, 1) == (64, 64)


def test_the_shortest_piece_and_a_vocabulary_without_sentinels():
  """Two tokens (one input, one target) is the shortest piece and is returned when
  nothing longer fits; one token less of room is a clear error. A prefix LM needs
  no sentinels, so a vocabulary without them still serves it; span corruption
  does not."""
  d = DENOISERS["prefix_lm"]
  assert ul2.piece_length(d, {"inputs": 1, "targets": 2}, 0, 100) == 2
  assert ul2.piece_length(d, {"inputs": 64, "targets": 1024}, 1, 0) == 64
  with pytest.raises(ValueError, match="too short"):
    ul2.piece_length(d, {"inputs": 1, "targets": 2}, 1, 100)
  with pytest.raises(ValueError, match="too short"):
    ul2.piece_length(DENOISERS["span3_r15"], {"inputs": 64, "targets": 64}, 1, 0)


def test_mode_ids_fall_back_to_text():
  class NoPieces:
    tokenizer = None

    def encode(self, s):
      return [ord(c) for c in s]

  assert ul2.mode_ids(NoPieces(), "[NLU]") == [ord(c) for c in "[NLU] "]
  assert ul2.mode_ids(NoPieces(), None) == []
