"""Real-data sources: text files, TFRecord, ArrayRecord, TFDS (RedPajama, The Stack).

Each builder returns a `Source`: a seqio DataSource plus the preprocessors that
turn its raw examples into {"targets": text}. Nothing is read at construction:
file patterns are globbed and TFDS builders loaded only when a dataset is asked
for, so registering tasks over gs:// paths or absent TFDS datasets is free and
offline. `tasks/` turns a Source into a causal-LM or a UL2 task.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Callable, Mapping, Optional, Sequence, Union

import gin
import seqio
import tensorflow as tf

FilePatterns = Mapping[str, Union[str, Sequence[str]]]
FILE_FORMATS = ("jsonl", "text")
RECORD_FORMATS = ("tf_example", "text")


@dataclasses.dataclass(frozen=True)
class Source:
  """A seqio source and the preprocessors giving {"targets": text}."""

  source: seqio.DataSource
  preprocessors: tuple[Callable, ...]


def _nonempty(dataset: tf.data.Dataset) -> tf.data.Dataset:
  return dataset.filter(lambda ex: tf.strings.length(ex["targets"]) > 0)


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

  return _nonempty(dataset.map(parse, num_parallel_calls=tf.data.AUTOTUNE))


def rename_text(dataset: tf.data.Dataset, text_feature: str = "text",
                ) -> tf.data.Dataset:
  """Returns examples {"targets": ex[text_feature]}, empty texts dropped."""
  return _nonempty(dataset.map(lambda ex: {"targets": ex[text_feature]},
                               num_parallel_calls=tf.data.AUTOTUNE))


@gin.configurable
def text_files(split_to_filepattern: FilePatterns = gin.REQUIRED,
               file_format: str = "jsonl", text_field: str = "text") -> Source:
  """Returns a Source over JSONL (`text_field`) or text-line files (gs:// ok)."""
  return Source(seqio.TextLineDataSource(dict(split_to_filepattern)), (
      functools.partial(parse_lines, file_format=file_format,
                        text_field=text_field),))


@gin.configurable
def tfrecord_files(split_to_filepattern: FilePatterns = gin.REQUIRED,
                   text_feature: str = "text") -> Source:
  """Returns a Source over TFRecord files of tf.train.Example with a bytes
  feature `text_feature`."""
  return Source(seqio.TFExampleDataSource(
      dict(split_to_filepattern),
      {text_feature: tf.io.FixedLenFeature([], tf.string)}),
                (functools.partial(rename_text, text_feature=text_feature),))


def _array_record_reader(record_format: str, text_feature: str):
  """Returns read_file_fn(filename) -> tf.data.Dataset of {text_feature: bytes}."""
  if record_format not in RECORD_FORMATS:
    raise ValueError(f"record_format {record_format!r} not in {RECORD_FORMATS}")

  def records(filename):
    from array_record.python import array_record_data_source as ards  # pylint: disable=g-import-not-at-top
    path = filename.decode() if isinstance(filename, bytes) else filename
    data = ards.ArrayRecordDataSource([path])
    for i in range(len(data)):
      yield data[i]

  def reader(filename):
    ds = tf.data.Dataset.from_generator(
        records, args=(filename,),
        output_signature=tf.TensorSpec([], tf.string))
    if record_format == "text":
      return ds.map(lambda r: {text_feature: r})
    spec = {text_feature: tf.io.FixedLenFeature([], tf.string)}
    return ds.map(lambda r: tf.io.parse_single_example(r, spec))

  return reader


@gin.configurable
def array_record_files(split_to_filepattern: FilePatterns = gin.REQUIRED,
                       text_feature: str = "text",
                       record_format: str = "tf_example") -> Source:
  """Returns a Source over ArrayRecord files whose records are serialized
  tf.train.Example (bytes feature `text_feature`) or raw UTF-8 text."""
  source = seqio.FileDataSource(
      _array_record_reader(record_format, text_feature),
      dict(split_to_filepattern))
  return Source(source, (functools.partial(rename_text,
                                           text_feature=text_feature),))


@gin.configurable
def tfds_dataset(tfds_name: str = gin.REQUIRED, text_feature: str = "text",
                 splits: Optional[Mapping[str, str]] = None,
                 data_dir: Optional[str] = None) -> Source:
  """Returns a Source over a TFDS dataset (loaded lazily, `data_dir` gs:// ok).

  `splits` maps our split names to TFDS splits or slices, e.g. RedPajama has
  only "train": {"train": "train[1%:]", "validation": "train[:1%]"}.
  """
  return Source(seqio.TfdsDataSource(tfds_name, tfds_data_dir=data_dir,
                                     splits=dict(splits) if splits else None),
                (functools.partial(rename_text, text_feature=text_feature),))
