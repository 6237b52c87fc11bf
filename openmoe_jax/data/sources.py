"""Real-data sources: text files, TFRecord, ArrayRecord, TFDS (RedPajama, The Stack).

Each builder returns a `Source`: a seqio DataSource plus the preprocessors that
turn its raw examples into {"targets": text}. Nothing is read at construction:
file patterns are globbed and TFDS builders loaded only when a dataset is asked
for, so registering tasks over gs:// paths or absent TFDS datasets is free and
offline. `tasks/` turns a Source into a causal-LM or a UL2 task.

Faults in the files (a pattern that matches nothing, an empty file, a corrupt
TFRecord or ArrayRecord, a JSONL line that is not JSON or lacks the text field)
raise `DataFileError` naming the file and the line or record: `validate_source`
checks the first records of every file before training; while reading, a bad
JSONL line is reported with its file and line number.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import gin
import seqio
import tensorflow as tf

from openmoe_jax import errors

FilePatterns = Mapping[str, Union[str, Sequence[str]]]
FILE_FORMATS = ("jsonl", "text")
RECORD_FORMATS = ("tf_example", "text")
# Marks the messages of errors raised inside tf.data, so that the pipeline can
# pull them out of TensorFlow's wrapping (`error_from_tf`).
_MARK = "openmoe_jax data error: "
VALIDATE_ATTR = "openmoe_validate"  # set on the seqio sources built here


class DataFileError(errors.InputError):
  """A data file is missing, empty or malformed; `path`, and `line` (1-based) or
  `record` (0-based) where known."""

  def __init__(self, message: str, path: Optional[str] = None,
               line: Optional[int] = None, record: Optional[int] = None):
    super().__init__(message)
    self.path, self.line, self.record = path, line, record


def error_from_tf(error: Exception) -> Optional[DataFileError]:
  """Returns the DataFileError a tf.data parse raised (None if it is not one)."""
  text = str(error)
  if _MARK not in text:
    return None
  return DataFileError(text.split(_MARK, 1)[1].splitlines()[0].rstrip(". "))


def _text_of(line: bytes, text_field: str, path: str, number: int) -> str:
  """Returns the `text_field` string of JSONL `line` (line `number` of `path`);
  raises DataFileError saying what is wrong with it."""
  where = f"{path}:{number}"
  try:
    record = json.loads(line)
  except ValueError as e:
    raise DataFileError(f"{where}: not a JSON line ({e}): {line[:80]!r}",
                        path, line=number) from None
  if not isinstance(record, dict) or text_field not in record:
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise DataFileError(f"{where}: no text field {text_field!r} (found {keys}); "
                        "set text_field to the field holding the text",
                        path, line=number)
  if not isinstance(record[text_field], str):
    raise DataFileError(f"{where}: field {text_field!r} is a "
                        f"{type(record[text_field]).__name__}, not a string",
                        path, line=number)
  return record[text_field]


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

  def field_of(line, path, number):
    try:
      return _text_of(line.numpy(), text_field, path.numpy().decode(),
                      int(number.numpy())).encode("utf-8")
    except DataFileError as e:
      raise ValueError(_MARK + str(e)) from None

  def parse(example):
    # Lines come with their file and number from `text_files`, bare otherwise.
    if isinstance(example, dict):
      line, path, number = example["line"], example["path"], example["number"]
    else:
      line, path, number = example, tf.constant("<unknown file>"), tf.constant(
          0, tf.int64)
    if file_format == "text":
      return {"targets": line}
    text = tf.py_function(field_of, [line, path, number], Tout=tf.string)
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
  """Returns a Source over JSONL (`text_field`) or text-line files (gs:// ok).

  JSONL lines carry their file and line number, so a bad line is reported there.
  """
  if file_format not in FILE_FORMATS:
    raise ValueError(f"file_format {file_format!r} not in {FILE_FORMATS}")
  patterns = dict(split_to_filepattern)
  source = (NumberedLineDataSource if file_format == "jsonl"
            else seqio.TextLineDataSource)(patterns)
  _attach_validator(source, patterns, functools.partial(
      _check_lines, file_format=file_format, text_field=text_field))
  return Source(source, (functools.partial(parse_lines, file_format=file_format,
                                           text_field=text_field),))


class NumberedLineDataSource(seqio.TextLineDataSource):
  """A TextLineDataSource (same files, order and sharding) whose examples are
  {"line", "path", "number"}, so that a parse error can name the file and line."""

  def __init__(self, split_to_filepattern: FilePatterns):
    super().__init__(split_to_filepattern)
    self._reader = _numbered_lines


def _numbered_lines(path) -> tf.data.Dataset:
  """Returns {"line", "path", "number" (1-based)} for each line of file `path`."""
  lines = tf.data.TextLineDataset(path)
  numbers = tf.data.Dataset.range(1, tf.int64.max)
  return tf.data.Dataset.zip((lines, numbers)).map(
      lambda line, n: {"line": line, "path": path, "number": n})


@gin.configurable
def tfrecord_files(split_to_filepattern: FilePatterns = gin.REQUIRED,
                   text_feature: str = "text") -> Source:
  """Returns a Source over TFRecord files of tf.train.Example with a bytes
  feature `text_feature`."""
  source = seqio.TFExampleDataSource(
      dict(split_to_filepattern),
      {text_feature: tf.io.FixedLenFeature([], tf.string)})
  _attach_validator(source, dict(split_to_filepattern), functools.partial(
      _check_tfrecords, text_feature=text_feature))
  return Source(source, (functools.partial(rename_text, text_feature=text_feature),))


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
  _attach_validator(source, dict(split_to_filepattern), functools.partial(
      _check_array_records, record_format=record_format,
      text_feature=text_feature))
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


# ------------------------------------------------------------------ validation


def _attach_validator(source: seqio.DataSource, patterns: dict,
                      check_file: Callable[[str, int], None]) -> None:
  """Gives `source` a `VALIDATE_ATTR` callable (split, max_records) -> files,
  which globs the split's patterns and runs `check_file(path, max_records)`."""

  def validate(split: str, max_records: int = 8) -> list[str]:
    files = matching_files(patterns, split)
    for path in files:
      check_file(path, max_records)
    return files

  setattr(source, VALIDATE_ATTR, validate)


def matching_files(split_to_filepattern: FilePatterns, split: str) -> list[str]:
  """Returns the files of `split`; raises DataFileError for a split that is not
  configured, or a pattern that matches no file, or an empty file."""
  if split not in split_to_filepattern:
    raise DataFileError(f"no {split!r} files configured (splits: "
                        f"{sorted(split_to_filepattern)})")
  patterns = split_to_filepattern[split]
  patterns = [patterns] if isinstance(patterns, str) else list(patterns)
  files = []
  for pattern in patterns:
    try:
      found = sorted(tf.io.gfile.glob(pattern))
    except tf.errors.OpError as e:
      raise DataFileError(f"{split} data {pattern}: cannot list files "
                          f"({e.message})", pattern) from None
    if not found:
      raise DataFileError(f"{split} data file pattern {pattern} matches no file",
                          pattern)
    for path in found:
      if tf.io.gfile.stat(path).length == 0:
        raise DataFileError(f"{path}: the data file is empty", path)
    files.extend(found)
  return files


def _check_lines(path: str, max_records: int, file_format: str,
                 text_field: str) -> None:
  """Reads the first `max_records` lines of `path`; raises DataFileError for a
  JSONL line that is not JSON or lacks `text_field`, or a file of blank lines."""
  texts = 0
  with tf.io.gfile.GFile(path, "rb") as f:
    for number, line in enumerate(f, start=1):
      if texts >= max_records:
        return
      if not line.strip():
        continue
      if file_format == "jsonl":
        _text_of(line, text_field, path, number)
      texts += 1
  if not texts:
    raise DataFileError(f"{path}: the data file holds only blank lines", path)


def _check_example(record: bytes, text_feature: str, path: str, index: int,
                   kind: str) -> None:
  """Raises DataFileError when `record` is not a tf.train.Example with a bytes
  feature `text_feature`."""
  try:
    example = tf.train.Example.FromString(record)
  except Exception:  # pylint: disable=broad-except
    raise DataFileError(f"{path}: {kind} record {index} is not a tf.train.Example",
                        path, record=index) from None
  feature = example.features.feature.get(text_feature)
  if feature is None or not feature.bytes_list.value:
    keys = sorted(example.features.feature)
    raise DataFileError(f"{path}: {kind} record {index} has no bytes feature "
                        f"{text_feature!r} (found {keys}); set text_feature",
                        path, record=index)


def _check_tfrecords(path: str, max_records: int, text_feature: str) -> None:
  """Reads the first `max_records` records of TFRecord file `path`; raises
  DataFileError for a corrupt record or one without `text_feature`."""
  index = 0
  try:
    for index, record in enumerate(
        tf.data.TFRecordDataset(path).take(max_records).as_numpy_iterator()):
      _check_example(record, text_feature, path, index, "TFRecord")
  except tf.errors.OpError as e:
    raise DataFileError(f"{path}: corrupt TFRecord file near record {index} "
                        f"({e.message})", path, record=index) from None


def _check_array_records(path: str, max_records: int, record_format: str,
                         text_feature: str) -> None:
  """Opens ArrayRecord file `path` and reads its first `max_records` records;
  raises DataFileError when it cannot be read or a record lacks `text_feature`."""
  from array_record.python import array_record_data_source as ards  # pylint: disable=g-import-not-at-top
  try:
    data = ards.ArrayRecordDataSource([path])
    records = [data[i] for i in range(min(len(data), max_records))]
  except Exception as e:  # pylint: disable=broad-except
    raise DataFileError(f"{path}: not a readable ArrayRecord file ({e})",
                        path) from None
  if not records:
    raise DataFileError(f"{path}: the ArrayRecord file holds no record", path)
  if record_format == "tf_example":
    for index, record in enumerate(records):
      _check_example(record, text_feature, path, index, "ArrayRecord")


def validate_source(source: Any, split: str = "train",
                    max_records: int = 8) -> list[str]:
  """Checks the files of `split` of a `Source` (or of a seqio source built here):
  every pattern matches, no file is empty, the first `max_records` records of
  each file parse. Returns the files; raises DataFileError naming the file and
  line or record. Sources not built here (TFDS, the embedded corpus) return []."""
  source = source.source if isinstance(source, Source) else source
  validate = getattr(source, VALIDATE_ATTR, None)
  return validate(split, max_records) if validate else []
