"""seqio Task and Mixture registrations (installed as `openmoe_jax.tasks`).

Registration is lazy: `register_tasks()` runs when the data pipeline asks for
a dataset, after gin has been parsed, so the gin-configured vocabulary size,
mixing rates and user file tasks are what gets registered.

Built in:
- `local_code`, `local_text`: the embedded corpus (stdlib code, English prose);
- `local_mix`: both, code share from `local_mix_rates.code_rate`.

User data through gin, no code change (JSONL with a text field, or plain text
lines, one example per line):

    register_tasks.file_tasks = [@web/text_file_task]
    web/text_file_task.name = "web"
    web/text_file_task.split_to_filepattern = {
        "train": "/data/web/train-*.jsonl", "validation": "/data/web/val.jsonl"}
    web/text_file_task.text_field = "text"
    web/text_file_task.vocabulary = @umt5/sentencepiece_vocabulary()
    umt5/sentencepiece_vocabulary.model_file = "/data/umt5.model"
    umt5/sentencepiece_vocabulary.extra_ids = 300
    register_tasks.mixtures = [@web_mix/task_mixture]
    web_mix/task_mixture.name = "web_mix"
    web_mix/task_mixture.tasks_and_rates = [("web", 3.0), ("local_code", 1.0)]
"""

from __future__ import annotations

import functools
import json
from typing import Callable, Mapping, Optional, Sequence, Union

import gin
import seqio
import tensorflow as tf

from openmoe_jax.data import corpus
from openmoe_jax.data import vocabulary as vocab_lib

LOCAL_CODE = "local_code"
LOCAL_TEXT = "local_text"
LOCAL_MIX = "local_mix"
FILE_FORMATS = ("jsonl", "text")
SHUFFLE_BUFFER_SIZE = 1000

FilePatterns = Mapping[str, Union[str, Sequence[str]]]


# ------------------------------------------------------------- preprocessors


def parse_lines(dataset: tf.data.Dataset, file_format: str = "jsonl",
                text_field: str = "text") -> tf.data.Dataset:
  """Returns examples {"targets": text} from raw lines, empty texts dropped.

  "jsonl" lines are JSON objects whose `text_field` holds the document (so
  newlines survive); "text" lines are the document themselves.
  """
  if file_format not in FILE_FORMATS:
    raise ValueError(f"file_format {file_format!r} not in {FILE_FORMATS}")

  def field_of(line):
    return json.loads(line.numpy())[text_field].encode("utf-8")

  def parse(line):
    if file_format == "text":
      return {"targets": line}
    text = tf.py_function(field_of, [line], Tout=tf.string)
    text.set_shape([])
    return {"targets": text}

  dataset = dataset.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
  return dataset.filter(lambda ex: tf.strings.length(ex["targets"]) > 0)


def split_to_length(dataset: tf.data.Dataset, sequence_length=None,
                    output_features=None) -> tf.data.Dataset:
  """Returns examples whose "targets" are cut into consecutive pieces that fit.

  Without this, trimming would keep only the first `sequence_length` tokens of
  each document and throw most of a long source file away.
  """
  del output_features
  if not sequence_length or sequence_length.get("targets") is None:
    return dataset
  length = int(sequence_length["targets"])

  def pieces(ex):
    tokens = ex["targets"]
    starts = tf.range(0, tf.size(tokens, out_type=tf.int64), length)
    return {"targets": tf.RaggedTensor.from_row_starts(tokens, starts)}

  return dataset.map(pieces, num_parallel_calls=tf.data.AUTOTUNE).unbatch()


# --------------------------------------------------------------- task builders


def make_text_file_task(
    name: str,
    split_to_filepattern: FilePatterns,
    vocabulary: Optional[seqio.Vocabulary] = None,
    file_format: str = "jsonl",
    text_field: str = "text",
    shuffle_buffer_size: int = SHUFFLE_BUFFER_SIZE,
) -> seqio.Task:
  """Registers (replacing any old one) and returns a causal-LM text task.

  Output: {"targets": int32 tokens}, EOS after each document, documents longer
  than the sequence length split into several examples.
  """
  if vocabulary is None:
    vocabulary = vocab_lib.get_vocabulary()
  seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.TextLineDataSource(dict(split_to_filepattern)),
      preprocessors=[
          functools.partial(parse_lines, file_format=file_format,
                            text_field=text_field),
          functools.partial(seqio.preprocessors.tokenize,
                            copy_pretokenized=False),
          seqio.preprocessors.append_eos,
          split_to_length,
      ],
      output_features={
          "targets": seqio.Feature(vocabulary=vocabulary, add_eos=True)},
      shuffle_buffer_size=shuffle_buffer_size,
  )


@gin.configurable
def text_file_task(
    name: str = gin.REQUIRED,
    split_to_filepattern: FilePatterns = gin.REQUIRED,
    text_field: str = "text",
    file_format: str = "jsonl",
    vocabulary: Optional[seqio.Vocabulary] = None,
    shuffle_buffer_size: int = SHUFFLE_BUFFER_SIZE,
) -> str:
  """Registers a user JSONL / text-line task (see module doc); returns its name.

  `vocabulary` None means the corpus vocabulary (`get_vocabulary`).
  """
  make_text_file_task(name, split_to_filepattern, vocabulary, file_format,
                      text_field, shuffle_buffer_size)
  return name


@gin.configurable
def task_mixture(
    name: str = gin.REQUIRED,
    tasks_and_rates: Sequence[tuple[str, float]] = gin.REQUIRED,
) -> str:
  """Registers (replacing) a mixture of registered tasks; returns its name."""
  seqio.MixtureRegistry.remove(name)
  seqio.MixtureRegistry.add(name, [(t, float(r)) for t, r in tasks_and_rates])
  return name


@gin.configurable
def local_mix_rates(code_rate: float = 0.5) -> dict[str, float]:
  """Returns the mixing rates of `local_mix`: code_rate and 1 - code_rate."""
  if not 0.0 <= code_rate <= 1.0:
    raise ValueError(f"code_rate must be in [0, 1], got {code_rate}")
  return {LOCAL_CODE: code_rate, LOCAL_TEXT: 1.0 - code_rate}


def _local_rate(task: seqio.Task) -> float:
  # Read at sampling time, so a gin change needs no re-registration.
  return local_mix_rates()[task.name]


@gin.configurable
def register_tasks(file_tasks: Sequence[Callable[[], str]] = (),
                   mixtures: Sequence[Callable[[], str]] = ()) -> list[str]:
  """(Re-)registers built-in and gin-configured tasks; returns their names.

  Idempotent and cheap; the pipeline calls it before every dataset, after gin
  is parsed. `file_tasks` / `mixtures` are gin references WITHOUT call
  parentheses (`@web/text_file_task`), called here after the built-ins so a
  user mixture may include `local_code`.
  """
  vocabulary = vocab_lib.get_vocabulary()
  for name, source in ((LOCAL_CODE, "code"), (LOCAL_TEXT, "text")):
    make_text_file_task(
        name, {split: corpus.corpus_file(source, split)
               for split in corpus.SPLITS}, vocabulary)
  seqio.MixtureRegistry.remove(LOCAL_MIX)
  seqio.MixtureRegistry.add(
      LOCAL_MIX, [(LOCAL_CODE, _local_rate), (LOCAL_TEXT, _local_rate)])
  names = [LOCAL_CODE, LOCAL_TEXT, LOCAL_MIX]
  names += [register() for register in (*file_tasks, *mixtures)]
  return names
