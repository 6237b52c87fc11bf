"""Task builders: register seqio causal-LM tasks and UL2 mixtures over any source.

`openmoe_jax.tasks` re-exports them; tasks/openmoe.py builds OpenMoE's mixtures
with them.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Optional, Sequence, Union

import seqio
import tensorflow as tf

from openmoe_jax.data import sources
from openmoe_jax.data import ul2
from openmoe_jax.data import vocabulary as vocab_lib

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
