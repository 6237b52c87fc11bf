"""Batches for training and eval: seqio mixture -> feature converter -> numpy.

`get_dataset` is deterministic given its arguments, so a restarted run that
passes `skip_batches=n` continues exactly where an uninterrupted run would be
after n batches.
"""

from __future__ import annotations

import inspect
import os
from typing import Callable, Iterator, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import gin  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import seqio  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

BATCH_KEYS = ("decoder_input_tokens", "decoder_target_tokens",
              "decoder_loss_weights", "decoder_segment_ids",
              "decoder_positions")
# Added to BATCH_KEYS for tasks with "inputs" (prefix LM / UL2): 1 on the
# inputs prefix plus the position that reads the last input token.
PREFIX_KEY = "decoder_causal_attention"


def _hide_accelerators_from_tf() -> None:
  # TF only feeds data here; left alone it would take GPU memory from JAX.
  try:
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:  # TF already initialised its devices
    pass


_hide_accelerators_from_tf()


# The package __init__ maps <repo>/tasks here in a source checkout too.
from openmoe_jax import tasks  # pylint: disable=g-import-not-at-top
from openmoe_jax.data import sources  # pylint: disable=g-import-not-at-top

DataFileError = sources.DataFileError


def vocabulary_for(mixture_or_task_name: str) -> seqio.Vocabulary:
  """Returns the targets vocabulary of a task or mixture (size: `.vocab_size`)."""
  tasks.register_tasks()
  provider = seqio.get_mixture_or_task(mixture_or_task_name)
  return provider.output_features["targets"].vocabulary


@gin.configurable
def feature_converter(provider: seqio.DatasetProviderBase, sequence_length: int,
                      pack: bool, inputs_fraction: float = 0.5,
                      converter_cls: Optional[type] = None):
  """Returns (seqio feature converter, task feature lengths) for a task/mixture.

  Default: `DecoderFeatureConverter` with {"targets": sequence_length} for
  causal-LM tasks; for tasks with "inputs" (UL2), `PrefixLMFeatureConverter`
  with inputs = round(inputs_fraction * sequence_length) and the rest targets,
  concatenated into rows of `sequence_length`. gin may force `converter_cls`.
  """
  has_inputs = "inputs" in provider.output_features
  if converter_cls is None:
    converter_cls = (seqio.PrefixLMFeatureConverter if has_inputs
                     else seqio.DecoderFeatureConverter)
  if not has_inputs:
    return converter_cls(pack=pack), {"targets": sequence_length}
  inputs = int(round(inputs_fraction * sequence_length))
  if not 0 < inputs < sequence_length:
    raise ValueError(f"inputs_fraction {inputs_fraction} leaves no inputs or "
                     f"no targets in {sequence_length} tokens")
  return converter_cls(pack=pack), {"inputs": inputs,
                                    "targets": sequence_length - inputs}


def _leaf_tasks(provider: seqio.DatasetProviderBase) -> list[seqio.Task]:
  """Returns the tasks of a task or (nested) mixture."""
  if isinstance(provider, seqio.Task):
    return [provider]
  return [t for sub in provider.tasks for t in _leaf_tasks(sub)]


def validate_data(mixture_or_task_name: str, splits=("train",),
                  max_records: int = 8) -> list[str]:
  """Checks the data files of a task or mixture before training: each file
  pattern matches, no file is empty, the first `max_records` records of every
  file parse (`sources.validate_source`). Splits a task does not have are
  skipped. Returns the files checked; raises DataFileError naming the file and
  line or record. Cheap: a glob and a few records per file."""
  tasks.register_tasks()
  files = []
  for task in _leaf_tasks(seqio.get_mixture_or_task(mixture_or_task_name)):
    for split in splits:
      if split in task.source.splits:
        files += sources.validate_source(task.source, split, max_records)
  return sorted(set(files))


def _batches(ds: tf.data.Dataset, name: str, split: str):
  """Yields the numpy batches of `ds`; raises DataFileError (file and line where
  known) when reading or parsing the data fails."""
  iterator = ds.as_numpy_iterator()
  while True:
    try:
      batch = next(iterator)
    except StopIteration:
      return
    except tf.errors.OpError as e:
      error = sources.error_from_tf(e)
      if error is not None:
        raise error from None
      raise DataFileError(f"reading the {split} data of {name} failed: "
                          f"{e.message.splitlines()[0] if e.message else e}") from e
    yield _with_segments(batch)


def _with_segments(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Adds segment ids / positions to an unpacked batch (one segment per row)."""
  if "decoder_segment_ids" not in batch:
    real = (batch["decoder_target_tokens"] != 0).astype(np.int32)
    batch["decoder_segment_ids"] = real
    positions = np.arange(real.shape[-1], dtype=np.int32)
    batch["decoder_positions"] = positions[None, :] * real
  keys = BATCH_KEYS + ((PREFIX_KEY,) if PREFIX_KEY in batch else ())
  return {k: np.asarray(batch[k], dtype=np.int32) for k in keys}


def get_dataset(
    mixture_or_task_name: str,
    sequence_length: int,
    batch_size: int,
    split: str = "train",
    shuffle: bool = True,
    seed: int = 0,
    repeat: bool = True,
    skip_batches: int = 0,
    pack: bool = True,
    shard_index: int = 0,
    num_shards: int = 1,
    num_batches: Optional[int] = None,
) -> Iterator[dict[str, np.ndarray]]:
  """Returns an iterator of int32 batches of shape [batch_size, sequence_length].

  Keys: BATCH_KEYS (decoder_{input,target}_tokens, _loss_weights,
  _segment_ids, _positions), plus PREFIX_KEY for tasks with "inputs" (UL2:
  loss weights on the targets only; see `feature_converter`). Packing puts
  several documents per row (segment ids 1, 2, ..., positions restart at 0;
  padding has segment 0 and weight 0).
  `skip_batches` drops that many batches first (resume); `num_batches` caps
  the count; `repeat=False` gives one pass (validation: also shuffle=False).
  `shard_index`/`num_shards` select this host's share of the examples.
  A data file that cannot be read or parsed raises DataFileError.
  """
  ds = _tf_dataset(mixture_or_task_name, sequence_length, batch_size, split=split,
                   shuffle=shuffle, seed=seed, repeat=repeat, skip_batches=skip_batches,
                   pack=pack, shard_index=shard_index, num_shards=num_shards,
                   num_batches=num_batches)
  return _batches(ds, mixture_or_task_name, split)


def _tf_dataset(mixture_or_task_name: str, sequence_length: int, batch_size: int, *,
                split: str, shuffle: bool, seed: int, repeat: bool, skip_batches: int,
                pack: bool, shard_index: int, num_shards: int,
                num_batches: Optional[int]) -> tf.data.Dataset:
  """Returns the tf.data pipeline behind `get_dataset` (same arguments). Building
  it traces every preprocessor (seconds); iterating it again replays the same
  batches when it neither shuffles nor samples without a seed."""
  tasks.register_tasks()
  shard_info = (seqio.ShardInfo(index=shard_index, num_shards=num_shards)
                if num_shards > 1 else None)
  converter, lengths = feature_converter(
      seqio.get_mixture_or_task(mixture_or_task_name), sequence_length, pack)
  ds = seqio.get_dataset(
      mixture_or_task_name,
      task_feature_lengths=lengths,
      feature_converter=converter,
      dataset_split=split,
      shuffle=shuffle,
      num_epochs=None if repeat else 1,
      shard_info=shard_info,
      verbose=False,
      seed=seed,
      batch_size=batch_size,
  )
  if skip_batches:
    ds = ds.skip(skip_batches)
  if num_batches is not None:
    ds = ds.take(num_batches)
  return ds.prefetch(2)


def get_sharded_dataset(mixture_or_task_name: str, sequence_length: int,
                        batch_size: int, shard_indices: Sequence[int],
                        num_shards: int, **kwargs) -> Iterator[dict[str, np.ndarray]]:
  """Returns an iterator of batches of `batch_size` rows made of the data shards
  `shard_indices` (of `num_shards`): each batch is batch_size / len(shard_indices)
  rows of `get_dataset` on each shard in turn, concatenated, so that the rows of
  one shard are the same whichever process reads it together with which others.
  `kwargs` go to `get_dataset` (split, seed, skip_batches, ...); the iterator
  ends with the shortest shard."""
  return sharded_passes(mixture_or_task_name, sequence_length, batch_size,
                        shard_indices, num_shards, **kwargs)()


def sharded_passes(mixture_or_task_name: str, sequence_length: int, batch_size: int,
                   shard_indices: Sequence[int], num_shards: int, split: str = "train",
                   **kwargs) -> Callable[[], Iterator[dict[str, np.ndarray]]]:
  """Returns a function that starts a new pass over `get_sharded_dataset`'s
  batches (same arguments). The pipeline is built once, here: evaluation calls
  the function at every eval step without tracing the preprocessors again; with
  shuffle=False each pass yields the same batches."""
  shard_indices = list(shard_indices)
  if not shard_indices or batch_size % len(shard_indices):
    raise ValueError(f"batch_size {batch_size} cannot be split evenly over the data "
                     f"shards {shard_indices}")
  settings = dict(_GET_DATASET_DEFAULTS, split=split, **kwargs)
  datasets = [_tf_dataset(mixture_or_task_name, sequence_length,
                          batch_size // len(shard_indices), shard_index=index,
                          num_shards=num_shards, **settings) for index in shard_indices]

  def new_pass() -> Iterator[dict[str, np.ndarray]]:
    parts = [_batches(ds, mixture_or_task_name, split) for ds in datasets]
    if len(parts) == 1:
      return parts[0]
    return ({k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
            for batches in zip(*parts))

  return new_pass


# get_dataset's keyword defaults, for the functions that forward to _tf_dataset.
_GET_DATASET_DEFAULTS = {
    name: p.default for name, p in inspect.signature(get_dataset).parameters.items()
    if p.default is not inspect.Parameter.empty and name not in (
        "shard_index", "num_shards", "split")}
