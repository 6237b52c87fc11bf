"""Data faults injected for real (issue 14, item 7): a missing file, an empty one,
a corrupt TFRecord, a JSONL line that is not JSON or lacks the text field. Each is
a DataFileError naming the file (and line or record), found before training by
`pipeline.validate_data`, and while reading by `pipeline.get_dataset`."""
import json

import gin
import pytest
import tensorflow as tf

from openmoe_jax.data import pipeline
from openmoe_jax.data import sources


def _jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def _good_docs(n=20):
  return [{"text": f"document number {i} with some words"} for i in range(n)]


def _tfrecord(path, texts, feature="text"):
  with tf.io.TFRecordWriter(str(path)) as writer:
    for text in texts:
      writer.write(tf.train.Example(features=tf.train.Features(feature={
          feature: tf.train.Feature(bytes_list=tf.train.BytesList(
              value=[text.encode()]))})).SerializeToString())
  return path


def _register(name, source_builder, **kwargs):
  """Registers task `name` over `source_builder(**kwargs)` through gin."""
  bindings = "\n".join(f"{name}/{source_builder}.{k} = {v!r}"
                       for k, v in kwargs.items())
  gin.parse_config(f"""
      register_tasks.file_tasks = [@{name}/source_task]
      {name}/source_task.name = "{name}"
      {name}/source_task.source = @{name}/{source_builder}()
      {bindings}
  """)


def _text_task(name, pattern, **kwargs):
  _register(name, "text_files", split_to_filepattern={"train": str(pattern)},
            **kwargs)


def test_good_files_pass_validation(tmp_path):
  _jsonl(tmp_path / "a.jsonl", _good_docs())
  _tfrecord(tmp_path / "b.tfrecord", ["one text", "two texts"])
  _text_task("ok_jsonl", tmp_path / "*.jsonl")
  assert pipeline.validate_data("ok_jsonl") == [str(tmp_path / "a.jsonl")]
  source = sources.tfrecord_files({"train": str(tmp_path / "*.tfrecord")})
  assert sources.validate_source(source) == [str(tmp_path / "b.tfrecord")]
  # The embedded corpus is JSONL files too.
  assert [f.rsplit("/", 1)[1] for f in pipeline.validate_data("local_code")] == [
      "code.train.jsonl"]


def test_missing_file(tmp_path):
  pattern = tmp_path / "nothing-*.jsonl"
  _text_task("missing", pattern)
  with pytest.raises(sources.DataFileError, match="matches no file") as error:
    pipeline.validate_data("missing")
  assert str(pattern) in str(error.value)


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty", "blank_lines"])
def test_empty_file(tmp_path, content):
  _jsonl(tmp_path / "a.jsonl", _good_docs())
  (tmp_path / "b.jsonl").write_text(content)
  _text_task("empty", tmp_path / "*.jsonl")
  with pytest.raises(sources.DataFileError, match="empty|blank") as error:
    pipeline.validate_data("empty")
  assert error.value.path == str(tmp_path / "b.jsonl")
  assert str(tmp_path / "b.jsonl") in str(error.value)


def test_jsonl_line_not_json_before_and_during_training(tmp_path):
  path = tmp_path / "bad.jsonl"
  lines = [json.dumps(d) for d in _good_docs(3)] + ['{"text": "cut off']
  path.write_text("\n".join(lines) + "\n")
  _text_task("not_json", path)
  with pytest.raises(sources.DataFileError) as error:
    pipeline.validate_data("not_json")
  assert f"{path}:4: not a JSON line" in str(error.value) and error.value.line == 4
  # Reading it (no preflight) names the same file and line.
  with pytest.raises(sources.DataFileError, match=f"{path}:4: not a JSON line"):
    next(pipeline.get_dataset("not_json", 32, 2, shuffle=False))


def test_jsonl_text_field_missing_before_and_during_training(tmp_path):
  path = _jsonl(tmp_path / "a.jsonl", _good_docs(5) + [{"body": "x"}])
  _text_task("no_field", path)
  with pytest.raises(sources.DataFileError, match="no text field 'text'") as error:
    pipeline.validate_data("no_field")
  assert f"{path}:6" in str(error.value) and "body" in str(error.value)
  with pytest.raises(sources.DataFileError, match=f"{path}:6: no text field"):
    list(pipeline.get_dataset("no_field", 32, 2, shuffle=False, repeat=False))


def test_corrupt_tfrecord(tmp_path):
  path = _tfrecord(tmp_path / "a.tfrecord", [f"text {i}" for i in range(4)])
  data = bytearray(path.read_bytes())
  data[20] ^= 0xFF  # inside the first record: its CRC no longer matches
  path.write_bytes(bytes(data))
  _register("bad_tfr", "tfrecord_files",
            split_to_filepattern={"train": str(path)})
  with pytest.raises(sources.DataFileError, match="corrupt TFRecord") as error:
    pipeline.validate_data("bad_tfr")
  assert str(path) in str(error.value) and error.value.record == 0
  with pytest.raises(sources.DataFileError, match="bad_tfr"):
    next(pipeline.get_dataset("bad_tfr", 32, 2, shuffle=False))


def test_truncated_tfrecord_and_missing_feature(tmp_path):
  path = _tfrecord(tmp_path / "a.tfrecord", ["a text"])
  path.write_bytes(path.read_bytes()[:-5])
  source = sources.tfrecord_files({"train": str(path)})
  with pytest.raises(sources.DataFileError, match="corrupt TFRecord"):
    sources.validate_source(source)
  other = _tfrecord(tmp_path / "b.tfrecord", ["a text"], feature="content")
  source = sources.tfrecord_files({"train": str(other)})
  with pytest.raises(sources.DataFileError, match="record 0 has no bytes feature "
                     "'text' \\(found \\['content'\\]\\)"):
    sources.validate_source(source)


def test_bad_array_record_file(tmp_path):
  pytest.importorskip("array_record")
  path = tmp_path / "a.array_record"
  path.write_bytes(b"this is not an array record file" * 4)
  source = sources.array_record_files({"train": str(path)})
  with pytest.raises(sources.DataFileError, match="not a readable ArrayRecord") as e:
    sources.validate_source(source)
  assert str(path) in str(e.value)


def test_empty_texts_are_dropped_from_every_line_format():
  """Blank text lines and JSONL records with an empty text are no documents; neither
  are empty TFRecord texts (rename_text)."""
  lines = tf.data.Dataset.from_tensor_slices([b"first", b"", b"second"])
  texts = [ex["targets"] for ex in sources.parse_lines(lines, "text").as_numpy_iterator()]
  assert texts == [b"first", b"second"]
  jsonl = tf.data.Dataset.from_tensor_slices(
      [json.dumps({"text": t}).encode() for t in ("a", "", "b")])
  texts = [ex["targets"] for ex in sources.parse_lines(jsonl, "jsonl").as_numpy_iterator()]
  assert texts == [b"a", b"b"]
  records = tf.data.Dataset.from_tensor_slices({"body": [b"x", b"", b"y"]})
  texts = [ex["targets"] for ex in
           sources.rename_text(records, "body").as_numpy_iterator()]
  assert texts == [b"x", b"y"]


def test_a_bad_line_shows_its_first_80_bytes_and_a_bare_one_an_unknown_file():
  """A line that is not JSON is quoted up to 80 bytes. Lines that come without their
  file (parse_lines over a plain dataset of lines) are reported at line 0 of an
  unknown file."""
  bad = b"{" + b"x" * 100
  with pytest.raises(sources.DataFileError) as error:
    sources._text_of(bad, "text", "f.jsonl", 3)  # pylint: disable=protected-access
  assert str(error.value).startswith("f.jsonl:3: not a JSON line (")
  assert str(error.value).endswith(f"): {bad[:80]!r}")
  assert (error.value.path, error.value.line) == ("f.jsonl", 3)
  lines = tf.data.Dataset.from_tensor_slices([json.dumps({"text": "ok"}).encode(), bad])
  with pytest.raises(tf.errors.OpError) as raised:
    list(sources.parse_lines(lines, "jsonl").as_numpy_iterator())
  found = sources.error_from_tf(raised.value)
  assert str(found).startswith("<unknown file>:0: not a JSON line (")
  assert sources.error_from_tf(ValueError("an error of another kind")) is None


def test_validation_reads_the_first_8_texts_of_each_file(tmp_path):
  """Blank lines are not texts; a bad 9th text is left to the reader (a fast
  preflight), unless more records are asked for."""
  path = tmp_path / "a.jsonl"
  lines = [json.dumps(d) for d in _good_docs(8)] + ["not json"]
  path.write_text("\n\n".join(lines) + "\n")
  source = sources.text_files({"train": str(path)})
  assert sources.validate_source(source) == [str(path)]
  assert getattr(source.source, sources.VALIDATE_ATTR)("train") == [str(path)]
  with pytest.raises(sources.DataFileError, match=f"{path}:17: not a JSON line"):
    sources.validate_source(source, max_records=9)


def test_a_one_byte_text_file_is_not_empty(tmp_path):
  (tmp_path / "one.txt").write_text("x")
  (tmp_path / "none.txt").write_text("")
  source = sources.text_files({"train": str(tmp_path / "one.txt"),
                               "validation": str(tmp_path / "none.txt")},
                              file_format="text")
  assert sources.validate_source(source) == [str(tmp_path / "one.txt")]
  with pytest.raises(sources.DataFileError) as error:
    sources.validate_source(source, "validation")
  assert str(error.value) == f"{tmp_path / 'none.txt'}: the data file is empty"


def test_array_record_validation_checks_examples_only_in_example_files(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  def write(name, records):
    writer = ArrayRecordWriter(str(tmp_path / name), "group_size:1")
    for record in records:
      writer.write(record)
    writer.close()
    return str(tmp_path / name)

  text = write("text.array_record", [b"a plain text", b"another"])
  assert sources.validate_source(sources.array_record_files(
      {"train": text}, record_format="text")) == [text]
  with pytest.raises(sources.DataFileError, match="ArrayRecord record 0 is not a "
                     "tf.train.Example|ArrayRecord record 0 has no bytes feature"):
    sources.validate_source(sources.array_record_files({"train": text}))
  empty = write("empty.array_record", [])
  with pytest.raises(sources.DataFileError) as error:
    sources.validate_source(sources.array_record_files(
        {"train": empty}, record_format="text"))
  assert str(error.value) == f"{empty}: the ArrayRecord file holds no record"
