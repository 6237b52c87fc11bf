"""Test helper: writes a checkpoint in t5x's on-disk layout, independently of our
reader (t5x/checkpoints.py: `Checkpointer.save` / `_get_spec`).

`checkpoint_<step>/checkpoint` is flax msgpack of `{version: 3, optimizer: {target,
state}}`; arrays at or above `inline_below` elements become zarr arrays (gzip) in
folders named by their '.'-joined path under `target.`, with a relative TensorStore
spec in their place; smaller ones are stored inline, as t5x does for unpartitioned
leaves.
"""
import os

import numpy as np
import tensorstore as ts
from flax import serialization, traverse_util


def _spec(name, array, gcs=False):
  """t5x's `_get_spec`: a local run's spec holds the path in its kvstore; a gs://
  run's names a dummy bucket in the kvstore and the path at the top level."""
  spec = {
      "driver": "zarr",
      "dtype": array.dtype.name,
      "kvstore": {"driver": "file", "path": name.replace("/", ".")},
      "metadata": {"compressor": {"id": "gzip"}, "shape": list(array.shape),
                   "chunks": list(array.shape)},
  }
  if gcs:
    spec["kvstore"] = {"driver": "gcs", "bucket": "t5x-dummy-bucket"}
    spec["path"] = name.replace("/", ".")
  return spec


def write_t5x_checkpoint(root, step, target_by_name, inline_below=16, gcs=False):
  """Writes `target_by_name` ({'decoder/layers_0/...': array}) as t5x step `step`
  under `root` with the specs of a local run, or of a gs:// run when `gcs` (the
  folders on disk are the same); returns the checkpoint_<step> folder."""
  directory = os.path.join(root, f"checkpoint_{step}")
  os.makedirs(directory)
  flat = {}
  for name, array in target_by_name.items():
    array = np.asarray(array, np.float32)
    if array.size < inline_below:
      flat[tuple(name.split("/"))] = array
      continue
    spec = _spec("target/" + name, array, gcs)
    folder = _spec("target/" + name, array)["kvstore"]["path"]
    absolute = dict(_spec("target/" + name, array),
                    kvstore={"driver": "file", "path": os.path.join(directory, folder)})
    store = ts.open(absolute, create=True, open=False).result()
    store.write(array).result()
    flat[tuple(name.split("/"))] = spec
  state = {"version": 3, "optimizer": {
      "target": traverse_util.unflatten_dict(flat),
      "state": {"step": np.asarray(step, np.int32), "param_states": {}}}}
  with open(os.path.join(directory, "checkpoint"), "wb") as f:
    f.write(serialization.msgpack_serialize(state))
  return directory
