"""How the corpus vocabulary is trained and cached (data/vocabulary.py), with the
corpus and SentencePiece replaced by stand-ins: the training sample's chunks and
per-source byte budgets, and one training per size and cache folder.

(The real cached vocabulary hides all of this from the other tests: they train it
once, or find it trained.)"""
from openmoe_jax.data import corpus
from openmoe_jax.data import vocabulary

LIMIT = vocabulary._CHUNK_CHARS  # pylint: disable=protected-access
_chunks = vocabulary._chunks  # pylint: disable=protected-access


def test_chunks_cut_at_line_ends_and_hold_at_most_the_limit():
  line = "x" * (LIMIT // 2 - 1) + "\n"
  assert _chunks(line * 5) == [line * 2, line * 2, line]  # the limit itself fits
  long = "y" * (LIMIT + 500) + "\n"  # a line over the limit is cut to it
  assert _chunks(long) == ["y" * LIMIT]
  assert _chunks("a\n" + long + "b") == ["a\n", "y" * LIMIT, "b"]
  assert _chunks("no newline") == ["no newline"]
  assert _chunks("") == []


def test_the_training_sample_takes_each_sources_budget_in_utf8_bytes(monkeypatch):
  """Pieces are taken until a source's bytes reach its budget: code pieces of 10
  bytes against 30 bytes give 3 (the budget itself is reached); text pieces of 4
  characters but 6 bytes ("éé0\\n") against 12 bytes give 2, not 3. Only the train
  split is read."""
  docs = {"code": [{"id": f"c{i}", "text": f"code{i:05d}\n"} for i in range(8)],
          "text": [{"id": f"t{i}", "text": f"éé{i}\n"} for i in range(8)]}
  read = []

  def read_documents(source, split):
    read.append((source, split))
    return docs[source]
  monkeypatch.setattr(corpus, "read_documents", read_documents)
  monkeypatch.setattr(vocabulary, "_SAMPLE_BYTES", {"code": 30, "text": 12})
  sample = vocabulary.training_sample()
  code = [p for p in sample if p.startswith("code")]
  text = [p for p in sample if p.startswith("é")]
  assert (len(code), len(text), len(sample)) == (3, 2, 5)
  assert all(len(p.encode("utf-8")) == 10 for p in code)
  assert sorted(read) == [("code", "train"), ("text", "train")]
  assert vocabulary.training_sample() == sample  # deterministic


def test_the_vocabulary_is_trained_once_per_size_and_cache_folder(tmp_path, monkeypatch):
  cache = tmp_path / "nested" / "cache"  # created on first use
  monkeypatch.setenv("OPENMOE_JAX_CACHE", str(cache))
  trained, announced, corpus_built = [], [], []

  def train(vocab_size):
    trained.append(vocab_size)
    return f"proto {vocab_size} #{len(trained)}".encode()
  monkeypatch.setattr(vocabulary, "_train", train)
  monkeypatch.setattr(corpus, "announce", announced.append)
  monkeypatch.setattr(corpus, "ensure_corpus", lambda: corpus_built.append(True))

  folder = cache / f"vocab_{vocabulary.VOCAB_VERSION}_{corpus.CORPUS_VERSION}"
  for _ in range(2):
    assert vocabulary.vocab_model_path(300) == str(folder / "spm_300.model")
  assert vocabulary.vocab_model_path(400) == str(folder / "spm_400.model")
  assert trained == [300, 400]
  assert (folder / "spm_300.model").read_bytes() == b"proto 300 #1"
  assert (folder / "spm_400.model").read_bytes() == b"proto 400 #2"
  assert sorted(p.name for p in folder.iterdir()) == ["spm_300.model", "spm_400.model"]
  assert len(corpus_built) == 2
  assert len(announced) == 2 and "300-piece SentencePiece vocabulary" in announced[0]
