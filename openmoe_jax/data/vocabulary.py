"""SentencePiece vocabulary trained on the embedded corpus, able to carry code.

The model keeps text byte-exact: identity normalisation, no whitespace
squeezing, whitespace-only pieces (indentation), byte fallback (tabs, rare
characters), no dummy prefix. Ids follow seqio: pad 0, eos 1, unk 2, no bos;
then the reserved pieces `[NLU]`, `[NLG]`, `[S2S]`, `<mask>` (ids 3-6) and 100
sentinels `<extra_id_i>` appended by seqio at the top of the id range.
"""

from __future__ import annotations

import functools
import io
import os
import random
import tempfile

import gin
import seqio

from openmoe_jax.data import corpus

DEFAULT_VOCAB_SIZE = 8192
EXTRA_IDS = 100
MODE_TOKENS = ("[NLU]", "[NLG]", "[S2S]")
MASK_TOKEN = "<mask>"
# Bump when training options change so cached models are rebuilt.
VOCAB_VERSION = "v1"

# Per-source byte budgets of the training sample: enough for stable pieces,
# small enough to train an 8k model in a few seconds on 2 cores.
_SAMPLE_BYTES = {"code": 1_200_000, "text": 800_000}
_CHUNK_CHARS = 2000  # SentencePiece skips "sentences" above max_sentence_length


def _chunks(text: str) -> list[str]:
  """Returns `text` cut at line ends into pieces of at most _CHUNK_CHARS."""
  out, cur = [], ""
  for line in text.splitlines(keepends=True):
    if cur and len(cur) + len(line) > _CHUNK_CHARS:
      out.append(cur)
      cur = ""
    cur += line[:_CHUNK_CHARS]
  if cur:
    out.append(cur)
  return out


def training_sample() -> list[str]:
  """Returns the deterministic sample of train-split chunks used for training."""
  sample = []
  for source, budget in _SAMPLE_BYTES.items():
    pieces = [c for d in corpus.read_documents(source, "train")
              for c in _chunks(d["text"])]
    random.Random(0).shuffle(pieces)
    used = 0
    for piece in pieces:
      if used >= budget:
        break
      sample.append(piece)
      used += len(piece.encode("utf-8"))
  random.Random(1).shuffle(sample)
  return sample


def _train(vocab_size: int) -> bytes:
  """Returns a serialized SentencePiece model trained on the corpus sample."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(training_sample()),
      model_writer=model,
      vocab_size=vocab_size,
      model_type="unigram",
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      allow_whitespace_only_pieces=True,
      split_by_whitespace=True,
      add_dummy_prefix=False,
      byte_fallback=True,
      split_digits=True,
      character_coverage=0.9999,
      max_sentence_length=4 * _CHUNK_CHARS + 16,
      user_defined_symbols=list(MODE_TOKENS) + [MASK_TOKEN],
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      num_threads=2,
      minloglevel=2,
  )
  return model.getvalue()


def vocab_model_path(vocab_size: int = DEFAULT_VOCAB_SIZE) -> str:
  """Returns the path of the cached SentencePiece model, training it if absent."""
  path = (corpus.cache_dir() / f"vocab_{VOCAB_VERSION}_{corpus.CORPUS_VERSION}"
          / f"spm_{vocab_size}.model")
  if path.exists():
    return str(path)
  with corpus.build_lock("vocab"):
    if not path.exists():
      path.parent.mkdir(parents=True, exist_ok=True)
      corpus.ensure_corpus()  # its own message first, if it is built now
      corpus.announce(f"Training the {vocab_size}-piece SentencePiece vocabulary on the "
                      f"embedded corpus (first use only; later runs reuse it) ...")
      proto = _train(vocab_size)
      fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
      with os.fdopen(fd, "wb") as f:
        f.write(proto)
      os.replace(tmp, path)
  return str(path)


@functools.lru_cache(maxsize=None)
def _load(model_path: str, extra_ids: int) -> seqio.SentencePieceVocabulary:
  return seqio.SentencePieceVocabulary(model_path, extra_ids=extra_ids)


@gin.configurable
def get_vocabulary(vocab_size: int = DEFAULT_VOCAB_SIZE,
                   extra_ids: int = EXTRA_IDS) -> seqio.SentencePieceVocabulary:
  """Returns the corpus vocabulary (`vocab_size` pieces + `extra_ids` sentinels).

  The same object is returned for the same size and cache dir.
  """
  return _load(vocab_model_path(vocab_size), extra_ids)


@gin.configurable
def sentencepiece_vocabulary(
    model_file: str, extra_ids: int = 0) -> seqio.SentencePieceVocabulary:
  """Returns a seqio vocabulary for a user SentencePiece model (e.g. umT5's).

  umT5 as OpenMoE used it: the umT5 model file with extra_ids=300.
  """
  return _load(str(model_file), extra_ids)


def _piece_id(vocab: seqio.Vocabulary, piece: str) -> int | None:
  tokenizer = getattr(vocab, "tokenizer", None)
  if tokenizer is None:
    return None
  idx = tokenizer.piece_to_id(piece)
  return None if idx == tokenizer.unk_id() else int(idx)


def sentinel_id(vocab: seqio.Vocabulary, i: int) -> int:
  """Returns the id of sentinel `<extra_id_i>` (seqio counts down from the top)."""
  if not 0 <= i < vocab.extra_ids:
    raise ValueError(f"sentinel {i} out of range: vocab has {vocab.extra_ids}")
  return vocab.vocab_size - 1 - i


def mask_token_id(vocab: seqio.Vocabulary) -> int:
  """Returns the diffusion mask id: `<mask>` if the vocab has it, else sentinel 0.

  The fallback lets user vocabularies without `<mask>` (umT5) run diffusion.
  """
  idx = _piece_id(vocab, MASK_TOKEN)
  if idx is not None:
    return idx
  if vocab.extra_ids:
    return sentinel_id(vocab, 0)
  raise ValueError(f"{vocab} has neither {MASK_TOKEN} nor extra ids")


def mode_token_id(vocab: seqio.Vocabulary, mode: str) -> int:
  """Returns the id of the single piece for a UL2 mode token like "[NLU]".

  Raises ValueError when the vocabulary has no such piece (umT5: encode the
  mode as text instead, as OpenMoE did).
  """
  if mode not in MODE_TOKENS:
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODE_TOKENS}")
  idx = _piece_id(vocab, mode)
  if idx is None:
    raise ValueError(f"{vocab} has no piece {mode!r}; encode it as text")
  return idx
