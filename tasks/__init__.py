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

from typing import Callable, Optional, Sequence

import gin
import seqio

from openmoe_jax.data import corpus
from openmoe_jax.data import sources
from openmoe_jax.data import vocabulary as vocab_lib
# Imported now, not lazily: its gin configurables must exist before gin locks.
from openmoe_jax.tasks import openmoe
from openmoe_jax.tasks.builders import (  # kept importable from here
    SHUFFLE_BUFFER_SIZE, FilePatterns, make_lm_task, make_source_task,
    make_text_file_task, make_ul2_tasks, split_to_length)

LOCAL_CODE = "local_code"
LOCAL_TEXT = "local_text"
LOCAL_MIX = "local_mix"
UL2_SUFFIX = "_ul2"
FILE_FORMATS = sources.FILE_FORMATS
parse_lines = sources.parse_lines  # kept importable from here


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
