"""seqio Task and Mixture registrations (installed as `openmoe_jax.tasks`).

Registration is lazy: `register_tasks()` runs when the data pipeline asks for
a dataset, after gin has been parsed, so the gin-configured vocabulary size,
mixing rates and user file tasks are what gets registered.

Built in:
- `local_code`, `local_text`: the embedded corpus (stdlib code, English prose);
- `local_mix`: both, code share from `local_mix_rates.code_rate`;
- `local_code_ul2`, `local_text_ul2`, `local_mix_ul2`: the same data as UL2
  (mixtures of one task per denoiser, `openmoe_jax.data.ul2`; same code rate).

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

`web/text_file_task.objective = "ul2"` makes `web` a UL2 mixture instead. Any
other source (TFRecord, ArrayRecord, TFDS: `openmoe_jax.data.sources`):

    register_tasks.file_tasks = [@stack/source_task]
    stack/source_task.name = "stack"
    stack/source_task.source = @stack/tfrecord_files()
    stack/tfrecord_files.split_to_filepattern = {"train": "gs://b/stack-*"}
    stack/tfrecord_files.text_feature = "content"

OpenMoE's real-data mixtures `openmoe_v1` .. `openmoe_v3` (+ `_ul2`) are
registered too (tasks/openmoe.py, `register_tasks.openmoe_mixtures`).
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Optional, Sequence, Union

import gin
import seqio
import tensorflow as tf

from openmoe_jax.data import corpus
from openmoe_jax.data import sources
from openmoe_jax.data import ul2
from openmoe_jax.data import vocabulary as vocab_lib
# Imported now, not lazily: its gin configurables must exist before gin locks.
from openmoe_jax.tasks import openmoe  # pylint: disable=g-import-not-at-top

LOCAL_CODE = "local_code"
LOCAL_TEXT = "local_text"
LOCAL_MIX = "local_mix"
UL2_SUFFIX = "_ul2"
FILE_FORMATS = sources.FILE_FORMATS
parse_lines = sources.parse_lines  # kept importable from here
SHUFFLE_BUFFER_SIZE = 1000

FilePatterns = Mapping[str, Union[str, Sequence[str]]]


# ------------------------------------------------------------- preprocessors


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


def make_lm_task(name: str, source: seqio.DataSource,
                 preprocessors: Sequence[Callable],
                 vocabulary: Optional[seqio.Vocabulary] = None,
                 shuffle_buffer_size: int = SHUFFLE_BUFFER_SIZE) -> seqio.Task:
  """Registers (replacing any old one) and returns a causal-LM task.

  `preprocessors` turn the source's examples into {"targets": text}. Output:
  {"targets": int32 tokens}, EOS after each document, documents longer than
  the sequence length split into several examples.
  """
  vocabulary = vocabulary or vocab_lib.get_vocabulary()
  seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name, source=source,
      preprocessors=[
          *preprocessors,
          functools.partial(seqio.preprocessors.tokenize,
                            copy_pretokenized=False),
          seqio.preprocessors.append_eos,
          split_to_length,
      ],
      output_features={
          "targets": seqio.Feature(vocabulary=vocabulary, add_eos=True)},
      shuffle_buffer_size=shuffle_buffer_size,
  )


def make_ul2_tasks(name: str, source: seqio.DataSource,
                   preprocessors: Sequence[Callable],
                   vocabulary: Optional[seqio.Vocabulary] = None,
                   shuffle_buffer_size: int = SHUFFLE_BUFFER_SIZE,
                   denoisers: Optional[Sequence[ul2.Denoiser]] = None,
                   ) -> seqio.Mixture:
  """Registers UL2 tasks `{name}_{denoiser.name}` and their mixture `name`.

  Returns the mixture (rates: the denoisers' rates, `ul2.ul2_denoisers()` by
  default). Examples: {"inputs": mode + corrupted text, "targets": ... + EOS}.
  Each task reads the source itself (as t5's ul2_objective streams do); the
  shuffle buffer is shared out so all of them hold `shuffle_buffer_size` docs.
  """
  vocabulary = vocabulary or vocab_lib.get_vocabulary()
  denoisers = denoisers or ul2.ul2_denoisers()
  shuffle_buffer_size = max(1, shuffle_buffer_size // len(denoisers))
  members = []
  for denoiser in denoisers:
    task_name = f"{name}_{denoiser.name}"
    seqio.TaskRegistry.remove(task_name)
    seqio.TaskRegistry.add(
        task_name, source=source,
        preprocessors=[
            *preprocessors,
            functools.partial(seqio.preprocessors.tokenize,
                              copy_pretokenized=False),
            ul2.denoiser_preprocessor(denoiser),
        ],
        output_features=ul2.output_features(vocabulary),
        shuffle_buffer_size=shuffle_buffer_size)
    members.append((task_name, float(denoiser.rate)))
  seqio.MixtureRegistry.remove(name)
  return seqio.MixtureRegistry.add(name, members)


def make_text_file_task(
    name: str,
    split_to_filepattern: FilePatterns,
    vocabulary: Optional[seqio.Vocabulary] = None,
    file_format: str = "jsonl",
    text_field: str = "text",
    shuffle_buffer_size: int = SHUFFLE_BUFFER_SIZE,
    objective: str = "lm",
) -> seqio.DatasetProviderBase:
  """Registers and returns a task over JSONL / text-line files.

  objective "lm": a causal-LM task (`make_lm_task`); "ul2": the UL2 mixture
  `name` of one task per denoiser (`make_ul2_tasks`).
  """
  return make_source_task(
      name, sources.text_files(split_to_filepattern, file_format, text_field),
      vocabulary, shuffle_buffer_size, objective)


def make_source_task(name: str, source: sources.Source,
                     vocabulary: Optional[seqio.Vocabulary] = None,
                     shuffle_buffer_size: int = SHUFFLE_BUFFER_SIZE,
                     objective: str = "lm") -> seqio.DatasetProviderBase:
  """Registers and returns a task over any `sources.Source` (objective "lm":
  causal-LM task `name`; "ul2": UL2 mixture `name`, one task per denoiser)."""
  if objective == "ul2":
    return make_ul2_tasks(name, source.source, source.preprocessors,
                          vocabulary, shuffle_buffer_size)
  if objective != "lm":
    raise ValueError(f"objective {objective!r} not in ('lm', 'ul2')")
  return make_lm_task(name, source.source, source.preprocessors, vocabulary,
                      shuffle_buffer_size)


@gin.configurable
def text_file_task(
    name: str = gin.REQUIRED,
    split_to_filepattern: FilePatterns = gin.REQUIRED,
    text_field: str = "text",
    file_format: str = "jsonl",
    vocabulary: Optional[seqio.Vocabulary] = None,
    shuffle_buffer_size: int = SHUFFLE_BUFFER_SIZE,
    objective: str = "lm",
) -> str:
  """Registers a user JSONL / text-line task (see module doc); returns its name.

  `vocabulary` None means the corpus vocabulary (`get_vocabulary`);
  `objective` "ul2" registers the UL2 mixture `name` instead (module doc).
  """
  make_text_file_task(name, split_to_filepattern, vocabulary, file_format,
                      text_field, shuffle_buffer_size, objective)
  return name


@gin.configurable
def source_task(
    name: str = gin.REQUIRED,
    source: sources.Source = gin.REQUIRED,
    objective: str = "lm",
    vocabulary: Optional[seqio.Vocabulary] = None,
    shuffle_buffer_size: int = SHUFFLE_BUFFER_SIZE,
) -> str:
  """Registers a task over a gin-built Source (TFRecord, ArrayRecord, TFDS,
  text files: `openmoe_jax.data.sources`); returns its name."""
  make_source_task(name, source, vocabulary, shuffle_buffer_size, objective)
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
                   mixtures: Sequence[Callable[[], str]] = (),
                   openmoe_mixtures: bool = True) -> list[str]:
  """(Re-)registers built-in and gin-configured tasks; returns their names.

  Idempotent and cheap; the pipeline calls it before every dataset, after gin
  is parsed. `file_tasks` / `mixtures` are gin references WITHOUT call
  parentheses (`@web/text_file_task`), called here after the built-ins so a
  user mixture may include `local_code`. `openmoe_mixtures`: also register
  OpenMoE's real-data mixtures (tasks/openmoe.py; nothing is read until used).
  """
  vocabulary = vocab_lib.get_vocabulary()
  for name, source in ((LOCAL_CODE, "code"), (LOCAL_TEXT, "text")):
    files = {split: corpus.corpus_file(source, split)
             for split in corpus.SPLITS}
    make_text_file_task(name, files, vocabulary)
    make_text_file_task(name + UL2_SUFFIX, files, vocabulary, objective="ul2")
  seqio.MixtureRegistry.remove(LOCAL_MIX)
  seqio.MixtureRegistry.add(
      LOCAL_MIX, [(LOCAL_CODE, _local_rate), (LOCAL_TEXT, _local_rate)])
  # Sub-mixture rates must be numbers: read now (this runs after gin parsing).
  rates = local_mix_rates()
  seqio.MixtureRegistry.remove(LOCAL_MIX + UL2_SUFFIX)
  seqio.MixtureRegistry.add(LOCAL_MIX + UL2_SUFFIX, [
      (LOCAL_CODE + UL2_SUFFIX, rates[LOCAL_CODE]),
      (LOCAL_TEXT + UL2_SUFFIX, rates[LOCAL_TEXT])])
  names = [LOCAL_CODE, LOCAL_TEXT, LOCAL_MIX, LOCAL_CODE + UL2_SUFFIX,
           LOCAL_TEXT + UL2_SUFFIX, LOCAL_MIX + UL2_SUFFIX]
  if openmoe_mixtures:
    names += openmoe.register_openmoe_mixtures()
  names += [register() for register in (*file_tasks, *mixtures)]
  return names
