"""Read a t5x checkpoint (OpenMoE's released JAX format) without t5x.

On disk (t5x/checkpoints.py): `checkpoint_<step>/checkpoint` is a flax-msgpack dict
`{version, optimizer: {target: params, state: ...}}` whose array leaves are either
inline numpy arrays (small ones) or TensorStore specs (dicts with `driver`,
`kvstore`, `metadata`) pointing at a zarr array folder relative to the checkpoint
folder, named like `target.decoder.layers_0.mlp.wi_0.kernel`. Arrays are read one
at a time, so host memory holds one tensor (plus what the caller keeps).
"""
import os
import re
from typing import Dict, List, Union

import numpy as np
import tensorstore as ts
from flax import serialization, traverse_util

from openmoe_jax.convert.layout import ConversionError

Leaf = Union[np.ndarray, Dict]


def find_checkpoint_dir(path: str) -> str:
  """Returns the `checkpoint_<step>` folder at `path`: `path` itself when it holds a
  `checkpoint` file, else its newest `checkpoint_<step>` child."""
  if os.path.isfile(os.path.join(path, "checkpoint")):
    return path
  if not os.path.isdir(path):
    raise ConversionError(f"{path}: no such directory")
  steps = sorted((int(m.group(1)), name) for name in os.listdir(path)
                 if (m := re.fullmatch(r"checkpoint_(\d+)", name))
                 and os.path.isfile(os.path.join(path, name, "checkpoint")))
  if not steps:
    raise ConversionError(f"{path} is not a t5x checkpoint: no `checkpoint` file and "
                          "no checkpoint_<step>/checkpoint inside")
  return os.path.join(path, steps[-1][1])


def _is_spec(leaf) -> bool:
  return isinstance(leaf, dict) and "driver" in leaf and (
      "kvstore" in leaf or "path" in leaf)


class T5xCheckpoint:
  """The parameters (`optimizer/target`) of one t5x checkpoint, read lazily.

  `names` are '/'-joined paths inside `target` (e.g. 'decoder/layers_0/mlp/wi_0/kernel');
  `read(name)` returns one array as float32 numpy.
  """

  def __init__(self, path: str):
    self.directory = find_checkpoint_dir(path)
    with open(os.path.join(self.directory, "checkpoint"), "rb") as f:
      try:
        contents = serialization.msgpack_restore(f.read())
      except Exception as e:  # msgpack raises several types on corrupt input
        raise ConversionError(f"{self.directory}/checkpoint is not a readable t5x "
                              f"msgpack file: {e}") from e
    target = contents.get("optimizer", {}).get("target") if isinstance(
        contents, dict) else None
    if not isinstance(target, dict):
      raise ConversionError(f"{self.directory}/checkpoint has no optimizer/target "
                            "parameters: not a t5x training checkpoint")
    self.version = contents.get("version")
    self._leaves: Dict[str, Leaf] = {
        "/".join(k): v for k, v in traverse_util.flatten_dict(
            target, is_leaf=lambda _, v: _is_spec(v) or not isinstance(v, dict)).items()}

  @property
  def names(self) -> List[str]:
    """Returns every parameter name in the checkpoint."""
    return list(self._leaves)

  def read(self, name: str) -> np.ndarray:
    """Returns parameter `name` as a float32 numpy array."""
    leaf = self._leaves[name]
    if not _is_spec(leaf):
      return np.asarray(leaf, np.float32)
    try:
      spec = _absolute_spec(self.directory, leaf)
    except ConversionError as e:
      raise ConversionError(f"parameter {name}: {e}") from None
    folder = spec["kvstore"]["path"]
    if not os.path.isdir(folder):
      raise ConversionError(f"parameter {name}: its array folder {folder} is missing")
    try:
      array = ts.open(spec, open=True, read=True).result().read().result()
    except Exception as e:  # tensorstore reports I/O and format errors alike
      raise ConversionError(f"parameter {name}: cannot read {folder}: {e}") from e
    return np.asarray(array, np.float32)


def _absolute_spec(directory: str, spec: Dict) -> Dict:
  """Returns a copy of a relative t5x TensorStore spec that reads from `directory`
  with the local file driver. The array's folder is in the kvstore's path (a local
  run), or at the spec's top level (a gs:// run, whose kvstore names a dummy gcs
  bucket; and tensorstore < 0.1.14); tensorstore joins the two when both are set."""
  spec = dict(spec)
  kvstore = spec.pop("kvstore", None) or {}
  parts = [p for p in (kvstore.get("path"), spec.pop("path", None)) if p]
  if not parts:
    raise ConversionError(f"its TensorStore spec names no array folder: {spec}")
  spec["kvstore"] = {"driver": "file", "path": os.path.join(directory, *parts)}
  return spec
