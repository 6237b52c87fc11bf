"""The readers of foreign checkpoints. t5x (convert/t5x_reader.py) on checkpoints
written in t5x's layout by tests/t5x_format.py: inline and TensorStore leaves, and
each way a folder can fail to be a readable t5x checkpoint, named. Hugging Face
safetensors (convert/hf_io.py): a single file, and the missing pieces named."""
import json
import os
import shutil

import numpy as np
import pytest
from flax import serialization

from openmoe_jax.convert.hf_io import (INDEX, SINGLE, SafetensorsReader, read_config,
                                       write_safetensors)
from openmoe_jax.convert.layout import ConversionError
from openmoe_jax.convert.t5x_reader import T5xCheckpoint, find_checkpoint_dir
from t5x_format import write_t5x_checkpoint

WEIGHTS = {"decoder/layers_0/mlp/wo/kernel": np.arange(32, dtype=np.float32).reshape(4, 8),
           "decoder/decoder_norm/scale": np.asarray([1.0, 2.0, 3.0], np.float32)}


def test_inline_and_tensorstore_leaves_read_as_float32(tmp_path):
  """The 3-element scale is stored inside the msgpack file (t5x keeps small leaves
  inline), the [4, 8] kernel in a zarr folder."""
  directory = write_t5x_checkpoint(str(tmp_path), 5, WEIGHTS)
  checkpoint = T5xCheckpoint(str(tmp_path))
  assert checkpoint.directory == directory and checkpoint.version == 3
  assert sorted(checkpoint.names) == sorted(WEIGHTS)
  for name, expected in WEIGHTS.items():
    array = checkpoint.read(name)
    assert array.dtype == np.float32
    np.testing.assert_array_equal(array, expected)
  assert not os.path.isdir(os.path.join(directory, "target.decoder.decoder_norm.scale"))


def _write_checkpoint_file(directory, contents: bytes):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "checkpoint"), "wb") as f:
    f.write(contents)


def test_a_folder_that_is_no_t5x_checkpoint_is_named(tmp_path):
  with pytest.raises(ConversionError, match="no such directory"):
    find_checkpoint_dir(str(tmp_path / "absent"))
  (tmp_path / "checkpoint_3").mkdir()  # no `checkpoint` file inside
  with pytest.raises(ConversionError, match=f"{tmp_path} is not a t5x checkpoint: no "
                     "`checkpoint` file and no checkpoint_<step>/checkpoint inside"):
    find_checkpoint_dir(str(tmp_path))
  _write_checkpoint_file(tmp_path / "garbage", b"\xc1 not msgpack")
  with pytest.raises(ConversionError, match="garbage/checkpoint is not a readable t5x "
                     "msgpack file"):
    T5xCheckpoint(str(tmp_path / "garbage"))
  for name, contents in (("no_target", {"version": 3, "optimizer": {"state": {}}}),
                         ("a_list", [1, 2])):
    _write_checkpoint_file(tmp_path / name, serialization.msgpack_serialize(contents))
    with pytest.raises(ConversionError, match=f"{name}/checkpoint has no "
                       "optimizer/target parameters: not a t5x training checkpoint"):
      T5xCheckpoint(str(tmp_path / name))


def test_an_unreadable_array_is_named_with_its_parameter(tmp_path):
  directory = write_t5x_checkpoint(str(tmp_path), 5, WEIGHTS)
  name = "decoder/layers_0/mlp/wo/kernel"
  folder = os.path.join(directory, "target.decoder.layers_0.mlp.wo.kernel")
  with open(os.path.join(folder, ".zarray")) as f:
    metadata = json.load(f)
  with open(os.path.join(folder, ".zarray"), "w") as f:
    json.dump(dict(metadata, shape=[4, 8, 2]), f)  # its chunk no longer fits
  with pytest.raises(ConversionError, match=f"parameter {name}: cannot read {folder}"):
    T5xCheckpoint(directory).read(name)
  shutil.rmtree(folder)
  with pytest.raises(ConversionError, match=f"parameter {name}: its array folder "
                     f"{folder} is missing"):
    T5xCheckpoint(directory).read(name)
  checkpoint = T5xCheckpoint(directory)
  checkpoint._leaves[name] = {"driver": "zarr", "path": ""}  # pylint: disable=protected-access
  with pytest.raises(ConversionError, match=f"parameter {name}: its TensorStore spec "
                     "names no array folder"):
    checkpoint.read(name)


def test_a_single_safetensors_file_reads_and_missing_pieces_are_named(tmp_path):
  tensors = [("a", np.arange(6, dtype=np.float32)), ("b", np.ones((2, 3), np.float16))]
  assert write_safetensors(str(tmp_path / "one"), iter(tensors)) == [SINGLE]
  reader = SafetensorsReader(str(tmp_path / "one"))
  assert sorted(reader.names) == ["a", "b"]
  for name, array in tensors:
    assert reader.read(name).dtype == np.float32
    np.testing.assert_array_equal(reader.read(name), array)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ConversionError, match=f"empty holds no {SINGLE} and no {INDEX}: "
                     "not a Hugging Face safetensors checkpoint"):
    SafetensorsReader(str(tmp_path / "empty"))
  write_safetensors(str(tmp_path / "two"), iter(tensors), max_shard_bytes=24)
  os.remove(tmp_path / "two" / "model-00002-of-00002.safetensors")
  with pytest.raises(ConversionError, match="two/model-00002-of-00002.safetensors is "
                     f"missing \\(named in {INDEX}\\)"):
    SafetensorsReader(str(tmp_path / "two"))
  with pytest.raises(ConversionError, match="empty/config.json is missing"):
    read_config(str(tmp_path / "empty"))
