"""The double-win study's data: a fixed subset of M unique training tokens of the
embedded corpus, repeated for as many epochs as the step budget needs, and held-out
validation documents that never enter training (the corpus splits documents by a
hash of their id, data/corpus.py).

Both are written as JSONL under <output>/data and registered as one seqio task,
`double_win`, through gin bindings (`gin_bindings`), so every arm reads them through
the same pipeline as any other run.
"""
import dataclasses
import json
import os
import random
from typing import Callable, Dict, List, Sequence

from openmoe_jax.data import corpus, pipeline

TASK = "double_win"
# A document contributes at most this many tokens (its beginning), so that a subset
# of M tokens spans many documents rather than a few long stdlib modules.
MAX_DOCUMENT_TOKENS = 1024


@dataclasses.dataclass
class StudyData:
  """Where the study's data lives and how big it is."""

  train_file: str
  validation_file: str
  train_documents: int
  validation_documents: int
  # Target tokens per epoch and held out, counted as the pipeline yields them (the
  # loss-weighted tokens of one pass, EOS included).
  train_tokens: int = 0
  train_rows: int = 0
  validation_tokens: int = 0


def select_documents(documents_by_source: Dict[str, List[Dict[str, str]]],
                     target_tokens: int, count_tokens: Callable[[str], List[int]],
                     decode: Callable[[List[int]], str], seed: int = 0
                     ) -> List[Dict[str, str]]:
  """Returns documents holding about `target_tokens` tokens, balanced over the
  sources: each source's documents are shuffled (seeded), then the next document of
  the source with the fewest tokens so far is added, cut to MAX_DOCUMENT_TOKENS; the
  last one is cut so that the total is `target_tokens`."""
  rng = random.Random(seed)
  queues = {}
  for source in sorted(documents_by_source):
    docs = list(documents_by_source[source])
    rng.shuffle(docs)
    queues[source] = docs
  taken = {source: 0 for source in queues}
  chosen = []
  total = 0
  while total < target_tokens and any(queues.values()):
    source = min((s for s in queues if queues[s]), key=lambda s: taken[s])
    doc = queues[source].pop(0)
    all_ids = count_tokens(doc["text"])
    ids = all_ids[:min(MAX_DOCUMENT_TOKENS, target_tokens - total)]
    if not ids:
      continue
    text = doc["text"] if len(ids) == len(all_ids) else decode(ids)
    chosen.append({"id": doc["id"], "text": text, "source": source})
    taken[source] += len(ids)
    total += len(ids)
  if total < target_tokens:
    raise ValueError(f"the corpus holds only {total} tokens, fewer than the "
                     f"{target_tokens} asked for")
  return chosen


def _write_jsonl(path: str, docs: Sequence[Dict[str, str]]) -> None:
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    for doc in docs:
      f.write(json.dumps(doc) + "\n")
  os.replace(path + ".tmp", path)


def write_study_data(folder: str, vocabulary, unique_tokens: int,
                     validation_tokens: int, seed: int = 0) -> StudyData:
  """Writes train.jsonl (about `unique_tokens` tokens of corpus training documents)
  and validation.jsonl (about `validation_tokens` of corpus validation documents)
  into `folder`; returns their StudyData (token counts not filled in yet)."""
  os.makedirs(folder, exist_ok=True)
  encode = lambda text: list(vocabulary.encode(text))
  decode = lambda ids: vocabulary.decode(ids)
  picked = {}
  for split, target in (("train", unique_tokens), ("validation", validation_tokens)):
    docs = {source: corpus.read_documents(source, split) for source in corpus.SOURCES}
    picked[split] = select_documents(docs, target, encode, decode, seed)
    _write_jsonl(os.path.join(folder, f"{split}.jsonl"), picked[split])
  return StudyData(os.path.join(folder, "train.jsonl"),
                   os.path.join(folder, "validation.jsonl"),
                   len(picked["train"]), len(picked["validation"]))


def gin_bindings(data: StudyData) -> List[str]:
  """Returns the gin bindings that register the `double_win` task over `data` and
  make it the run's training and evaluation task."""
  files = {"train": data.train_file, "validation": data.validation_file}
  return [f"double_win/text_file_task.name = '{TASK}'",
          f"double_win/text_file_task.split_to_filepattern = {files!r}",
          "register_tasks.file_tasks = [@double_win/text_file_task]",
          f"MIXTURE_OR_TASK_NAME = '{TASK}'"]


def one_pass(split: str, sequence_length: int, batch_size: int) -> List[Dict]:
  """Returns the batches of one ordered pass over the study task's `split` (packed
  as in training); gin must hold `gin_bindings`."""
  return list(pipeline.get_dataset(TASK, sequence_length, batch_size, split=split,
                                   shuffle=False, repeat=False, pack=True))


def count_tokens(batches: Sequence[Dict]) -> Dict[str, int]:
  """Returns {"tokens": loss-weighted target tokens, "rows": rows holding any}."""
  tokens = rows = 0
  for batch in batches:
    weights = batch["decoder_loss_weights"] > 0
    tokens += int(weights.sum())
    rows += int(weights.any(axis=1).sum())
  return {"tokens": tokens, "rows": rows}
