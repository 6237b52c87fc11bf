"""Tests for the data layer: corpus, vocabulary, seqio tasks, batch pipeline."""

import json
import pathlib
import shutil
import sysconfig
import types

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

from openmoe_jax.data import corpus
from openmoe_jax.data import pipeline
from openmoe_jax.data import vocabulary as vocab_lib

SEQ = 128


@pytest.fixture(scope="session")
def vocab():
  """The default corpus vocabulary (built into the cache on first use)."""
  return vocab_lib.get_vocabulary()


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _check_batch(batch, batch_size, length):
  """Checks keys, dtypes, shapes and the packed-batch invariants row by row."""
  assert set(batch) == set(pipeline.BATCH_KEYS)
  for key, value in batch.items():
    assert value.dtype == np.int32, key
    assert value.shape == (batch_size, length), key
  tgt, inp = batch["decoder_target_tokens"], batch["decoder_input_tokens"]
  seg, pos = batch["decoder_segment_ids"], batch["decoder_positions"]
  pad = seg == 0
  np.testing.assert_array_equal(batch["decoder_loss_weights"], (~pad) * 1)
  assert (tgt[pad] == 0).all() and (pos[pad] == 0).all()
  assert (tgt[~pad] != 0).all()
  for row in range(batch_size):
    for s in np.unique(seg[row][seg[row] > 0]):
      idx = np.flatnonzero(seg[row] == s)
      np.testing.assert_array_equal(pos[row, idx], np.arange(len(idx)))
      assert inp[row, idx[0]] == 0  # each segment starts from BOS=0
      np.testing.assert_array_equal(inp[row, idx[1:]], tgt[row, idx[:-1]])


# ------------------------------------------------------------------ corpus


def test_corpus_splits_disjoint_and_deterministic(vocab):
  del vocab
  stats = corpus.corpus_stats()
  for source in corpus.SOURCES:
    train = corpus.read_documents(source, "train")
    valid = corpus.read_documents(source, "validation")
    assert len(train) > 100 and len(valid) >= 5
    train_ids = {d["id"] for d in train}
    valid_ids = {d["id"] for d in valid}
    assert not train_ids & valid_ids
    assert len(train_ids) == len(train) and len(valid_ids) == len(valid)
    assert all(corpus.split_of(i) == "validation" for i in valid_ids)
    assert all(corpus.split_of(i) == "train" for i in train_ids)
    assert [d["id"] for d in corpus.read_documents(source, "train")] == [
        d["id"] for d in train]
    share = stats[f"{source}/validation"]["docs"] / stats[f"{source}/train"]["docs"]
    assert 0.005 < share < 0.06
  assert stats["code/train"]["bytes"] > 3_000_000
  assert stats["text/train"]["bytes"] > 500_000


def test_corpus_sources_hold_code_and_prose(vocab):
  del vocab
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  code = {d["id"]: d["text"] for d in corpus.read_documents("code", "train")}
  some_id = sorted(code)[0]
  assert some_id.startswith("stdlib/")
  on_disk = (root / some_id[len("stdlib/"):]).read_text(encoding="utf-8")
  assert code[some_id] == on_disk
  assert not any("site-packages" in i or "/test/" in i for i in code)
  text_ids = [d["id"] for d in corpus.read_documents("text", "train")]
  assert any(i.startswith("topics/") for i in text_ids)
  assert any(i.startswith("docstrings/") for i in text_ids)


def test_cache_dir_is_read_at_call_time(monkeypatch, tmp_path):
  monkeypatch.setenv("OPENMOE_JAX_CACHE", str(tmp_path))
  assert corpus.cache_dir() == tmp_path
  assert corpus.corpus_dir().parent == tmp_path


# -------------------------------------------------------------- vocabulary


def test_vocabulary_ids_and_special_tokens(vocab):
  assert vocab.vocab_size == vocab_lib.DEFAULT_VOCAB_SIZE + vocab_lib.EXTRA_IDS
  assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
  assert vocab.bos_id in (None, -1)
  modes = [vocab_lib.mode_token_id(vocab, m) for m in vocab_lib.MODE_TOKENS]
  assert modes == [3, 4, 5]
  assert vocab_lib.mask_token_id(vocab) == 6
  assert vocab.encode("[NLU]") == [3] and vocab.encode("<mask>") == [6]
  assert vocab_lib.sentinel_id(vocab, 0) == vocab.vocab_size - 1
  assert vocab_lib.sentinel_id(vocab, 99) == vocab.vocab_size - 100
  assert vocab.tokenizer.id_to_piece(vocab_lib.sentinel_id(vocab, 5)).endswith(
      "<extra_id_5>")
  with pytest.raises(ValueError):
    vocab_lib.sentinel_id(vocab, 100)
  with pytest.raises(ValueError):
    vocab_lib.mode_token_id(vocab, "[XYZ]")
  assert vocab_lib.get_vocabulary() is vocab


def test_vocabulary_round_trips_python_source_and_english(vocab):
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  sources = [(root / name).read_text(encoding="utf-8")
             for name in ("textwrap.py", "json/encoder.py", "this.py")]
  sources += [d["text"] for d in corpus.read_documents("code", "validation")]
  sources.append("def f(x):\n\tif x:\n\t\treturn  x   # tabs\n\n\n  \n")
  english = [d["text"] for d in corpus.read_documents("text", "validation")]
  english.append("Naïve café — “quotes”, emoji 🙂, CJK 漢字 and  two  spaces.\n")
  for s in sources + english:
    ids = vocab.encode(s)
    assert vocab.decode(ids) == s
    tf_ids = vocab.encode_tf(tf.constant(s))
    assert vocab.decode_tf(tf_ids).numpy().decode("utf-8") == s
  indented = vocab.encode("        return x\n")
  assert len(indented) <= 5  # indentation is a few pieces, not 8 bytes
  assert vocab.unk_id not in vocab.encode(sources[-1] + english[-1])


def test_sentencepiece_vocabulary_from_user_path(vocab, tmp_path):
  user_model = tmp_path / "user.model"
  shutil.copy(vocab.sentencepiece_model_file, user_model)
  gin.parse_config(f"""
      sentencepiece_vocabulary.model_file = "{user_model}"
      sentencepiece_vocabulary.extra_ids = 7
  """)
  user = vocab_lib.sentencepiece_vocabulary()
  assert user.vocab_size == vocab_lib.DEFAULT_VOCAB_SIZE + 7
  assert vocab_lib.sentinel_id(user, 0) == user.vocab_size - 1
  assert user.decode(user.encode("x = 1\n")) == "x = 1\n"


# ------------------------------------------------------------ tasks & batches


def test_task_outputs_and_packed_batches(vocab):
  assert pipeline.vocabulary_for("local_mix") == vocab
  import openmoe_jax.tasks as registrations  # pylint: disable=g-import-not-at-top
  assert registrations is pipeline.tasks
  task = seqio.get_mixture_or_task("local_code")
  assert set(task.splits) == {"train", "validation"}
  ex = next(task.get_dataset({"targets": SEQ}, split="validation",
                             shuffle=False).as_numpy_iterator())
  assert ex["targets"].dtype == np.int32 and 0 < len(ex["targets"]) <= SEQ

  batches = _take(pipeline.get_dataset("local_mix", 256, 4, seed=1), 3)
  for batch in batches:
    _check_batch(batch, 4, 256)
  segments = max(b["decoder_segment_ids"].max() for b in batches)
  assert segments >= 2  # short documents and document tails get packed
  docs_end = sum((b["decoder_target_tokens"] == vocab.eos_id).sum()
                 for b in batches)
  assert docs_end >= 1


def test_unpacked_batches_have_one_segment(vocab):
  del vocab
  batch = next(pipeline.get_dataset("local_text", SEQ, 3, pack=False))
  _check_batch(batch, 3, SEQ)
  assert batch["decoder_segment_ids"].max() == 1


def test_skip_batches_resume_matches_uninterrupted_stream(vocab):
  del vocab
  args = dict(mixture_or_task_name="local_mix", sequence_length=SEQ,
              batch_size=2, seed=7)
  full = _take(pipeline.get_dataset(**args), 6)
  # A resumed stream only matches if the whole pipeline is deterministic.
  resumed = _take(pipeline.get_dataset(**args, skip_batches=4), 2)
  _assert_batches_equal(full[4:], resumed)
  other = next(pipeline.get_dataset(**{**args, "seed": 8}))
  assert not np.array_equal(other["decoder_target_tokens"],
                            full[0]["decoder_target_tokens"])


def test_validation_is_finite_deterministic_and_shardable(vocab):
  del vocab
  args = dict(mixture_or_task_name="local_text", sequence_length=SEQ,
              batch_size=4, split="validation", shuffle=False, repeat=False)
  first = list(pipeline.get_dataset(**args))
  assert 2 < len(first) < 1000
  _assert_batches_equal(first, list(pipeline.get_dataset(**args)))
  assert len(list(pipeline.get_dataset(**args, num_batches=2))) == 2
  shard0 = next(pipeline.get_dataset(**args, num_shards=2, shard_index=0))
  shard1 = next(pipeline.get_dataset(**args, num_shards=2, shard_index=1))
  assert not np.array_equal(shard0["decoder_target_tokens"],
                            shard1["decoder_target_tokens"])


def test_eval_passes_build_the_pipeline_once_and_replay_the_same_batches(
    vocab, monkeypatch):
  # The trainer evaluates through sharded_passes: a mixture (seeded sampling between
  # its tasks) on two data shards, read twice, must give get_sharded_dataset's
  # batches both times, from one seqio pipeline per shard.
  del vocab
  args = dict(mixture_or_task_name="local_mix", sequence_length=SEQ, batch_size=4,
              shard_indices=[0, 1], num_shards=2, split="validation", shuffle=False,
              repeat=False, num_batches=3)
  expected = list(pipeline.get_sharded_dataset(**args))
  assert len(expected) == 3
  built = []
  real = seqio.get_dataset
  monkeypatch.setattr(seqio, "get_dataset",
                      lambda *a, **k: built.append(a) or real(*a, **k))
  new_pass = pipeline.sharded_passes(**args)
  _assert_batches_equal(expected, list(new_pass()))
  _assert_batches_equal(expected, list(new_pass()))
  assert len(built) == 2  # one per shard, not one per pass


@pytest.mark.parametrize("shard_indices", [[0, 1, 2], []])
def test_eval_passes_refuse_a_batch_that_does_not_split_over_the_shards(
    shard_indices):
  # Checked before any pipeline is built: 4 rows over 3 shards would give each
  # shard 1 row (3 in all) and no shards would give none.
  with pytest.raises(ValueError, match="cannot be split evenly over the data shards"):
    pipeline.sharded_passes("local_text", SEQ, 4, shard_indices, 3,
                            split="validation")


def _code_share(vocab, name, n_batches=6, batch_size=64):
  """Returns the share of unpacked examples that are not from the prose corpus."""
  prose = "\n".join(d["text"] for d in corpus.read_documents("text", "train"))
  is_code = []
  for batch in _take(pipeline.get_dataset(name, 64, batch_size, pack=False,
                                          seed=3), n_batches):
    for row in batch["decoder_target_tokens"]:
      ids = [int(t) for t in row if t not in (0, vocab.eos_id)]
      snippet = vocab.decode(ids[2:-2])
      if len(snippet) >= 20:
        is_code.append(snippet not in prose)
  assert len(is_code) > n_batches * batch_size // 2
  return float(np.mean(is_code))


def test_mixture_code_rate_changes_realised_share(vocab):
  assert _code_share(vocab, "local_code", 2) > 0.9
  assert _code_share(vocab, "local_text", 2) < 0.1
  gin.bind_parameter("local_mix_rates.code_rate", 0.15)
  low = _code_share(vocab, "local_mix")
  gin.bind_parameter("local_mix_rates.code_rate", 0.5)
  half = _code_share(vocab, "local_mix")
  assert 0.07 < low < 0.25
  assert 0.38 < half < 0.62


def test_text_file_tasks_and_mixture_from_gin(vocab, tmp_path):
  docs = [f"doc {i}:\n    indented line {i}\n\tand a tab\n" for i in range(40)]
  with open(tmp_path / "train.jsonl", "w") as f:
    for i, d in enumerate(docs):
      f.write(json.dumps({"body": d, "n": i}) + "\n")
  with open(tmp_path / "valid.jsonl", "w") as f:
    for d in docs[:6]:
      f.write(json.dumps({"body": d}) + "\n")
  lines = [f"plain line number {i}" for i in range(30)]
  (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
  user_model = tmp_path / "user.model"
  shutil.copy(vocab.sentencepiece_model_file, user_model)
  gin.parse_config(f"""
      register_tasks.file_tasks = [@tiny_json/text_file_task,
                                   @tiny_txt/text_file_task]
      tiny_json/text_file_task.name = "tiny_json"
      tiny_json/text_file_task.split_to_filepattern = {{
          "train": "{tmp_path}/train.jsonl",
          "validation": "{tmp_path}/valid.jsonl"}}
      tiny_json/text_file_task.text_field = "body"
      tiny_txt/text_file_task.name = "tiny_txt"
      tiny_txt/text_file_task.file_format = "text"
      tiny_txt/text_file_task.split_to_filepattern = {{
          "train": "{tmp_path}/*.txt"}}
      tiny_txt/text_file_task.vocabulary = @user/sentencepiece_vocabulary()
      user/sentencepiece_vocabulary.model_file = "{user_model}"
      user/sentencepiece_vocabulary.extra_ids = 3
      register_tasks.mixtures = [@tiny_mix/task_mixture]
      tiny_mix/task_mixture.name = "tiny_mix"
      tiny_mix/task_mixture.tasks_and_rates = [("tiny_json", 1), ("local_code", 1)]
  """)
  valid = list(pipeline.get_dataset("tiny_json", 64, 2, split="validation",
                                    shuffle=False, repeat=False))
  decoded = []
  for batch in valid:
    _check_batch(batch, 2, 64)
    for tgt, seg in zip(batch["decoder_target_tokens"],
                        batch["decoder_segment_ids"]):
      for s in range(1, seg.max() + 1):
        ids = tgt[seg == s].tolist()
        assert ids[-1] == vocab.eos_id
        decoded.append(vocab.decode(ids[:-1]))
  assert sorted(decoded) == sorted(docs[:6])
  assert max(b["decoder_segment_ids"].max() for b in valid) >= 2

  assert pipeline.vocabulary_for("tiny_txt").vocab_size == (
      vocab_lib.DEFAULT_VOCAB_SIZE + 3)
  batch = next(pipeline.get_dataset("tiny_txt", 32, 2))
  _check_batch(batch, 2, 32)
  assert vocab.decode(batch["decoder_target_tokens"][0].tolist()) in lines
  _check_batch(next(pipeline.get_dataset("tiny_mix", 64, 2)), 2, 64)


def test_unpacked_rows_get_one_segment_and_zero_positions_on_padding():
  """An unpacked batch (seqio gives no segment ids or positions) gets segment 1 and
  positions 0, 1, ... on each row's tokens, and segment 0 and position 0 on its
  padding (where the target is 0), as packed batches have."""
  targets = np.array([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]], np.int64)
  inputs = np.array([[0, 5, 6, 7, 0], [0, 8, 9, 10, 11]], np.int64)
  batch = pipeline._with_segments({  # pylint: disable=protected-access
      "decoder_input_tokens": inputs, "decoder_target_tokens": targets,
      "decoder_loss_weights": (targets != 0).astype(np.int64)})
  assert set(batch) == set(pipeline.BATCH_KEYS)
  np.testing.assert_array_equal(batch["decoder_segment_ids"],
                                [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(batch["decoder_positions"],
                                [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]])
  assert all(v.dtype == np.int32 for v in batch.values())


def test_a_vocabulary_without_mask_or_mode_pieces_falls_back_or_refuses():
  """SentencePiece maps an unknown piece to unk: such a piece is absent, so the mask
  is sentinel 0 (the top id) and a missing mode token is refused, never unk."""

  class Tokenizer:
    def piece_to_id(self, piece):
      return {"[NLU]": 3}.get(piece, 2)

    def unk_id(self):
      return 2

  vocab = types.SimpleNamespace(tokenizer=Tokenizer(), extra_ids=100, vocab_size=1000)
  assert vocab_lib.mask_token_id(vocab) == 999
  assert vocab_lib.mode_token_id(vocab, "[NLU]") == 3
  with pytest.raises(ValueError, match="no piece"):
    vocab_lib.mode_token_id(vocab, "[NLG]")
  no_extra_ids = types.SimpleNamespace(tokenizer=Tokenizer(), extra_ids=0, vocab_size=1000)
  with pytest.raises(ValueError, match="has neither <mask> nor extra ids"):
    vocab_lib.mask_token_id(no_extra_ids)
