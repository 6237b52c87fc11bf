"""Params-only exports: the artifact for serving, sharing and starting new runs.

A params export is a folder holding
  params/       an Orbax pytree checkpoint of the model parameters only
  config.gin    the gin config the model is built from (a run's config.gin)
  export.json   {format, step, dtype, source}
`openmoe-eval`, `openmoe-sample`, `openmoe_jax.load_model` read it like a MODEL_DIR,
and `openmoe-train` pointed at it (MODEL_DIR with no training checkpoint yet) starts
from these parameters with a fresh optimizer state at the export's step.
"""
import json
import os
import shutil
from typing import Any, Dict, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

FORMAT = "openmoe_jax.params/1"
_PARAMS, _META, _CONFIG = "params", "export.json", "config.gin"


def is_params_export(directory: str) -> bool:
  """Returns whether `directory` holds a params export."""
  return os.path.isfile(os.path.join(directory, _META)) and os.path.isdir(
      os.path.join(directory, _PARAMS))


def read_metadata(directory: str) -> Dict[str, Any]:
  """Returns the export's export.json contents."""
  with open(os.path.join(directory, _META)) as f:
    meta = json.load(f)
  if meta.get("format") != FORMAT:
    raise ValueError(f"{directory}/{_META}: format {meta.get('format')!r}, expected "
                     f"{FORMAT!r}")
  return meta


def save(directory: str, params: Any, step: int, config_gin: str, source: str,
         dtype: Optional[str] = None) -> str:
  """Writes a params export of `params` (cast to `dtype` if given) to `directory`
  (which must not hold one yet); returns `directory`. Consumes `params`: numpy
  leaves of a dict tree are replaced by device arrays in place."""
  if os.path.exists(os.path.join(directory, _PARAMS)):
    raise FileExistsError(f"{directory}/{_PARAMS} exists; pick a new --output")
  os.makedirs(directory, exist_ok=True)
  if dtype is not None:
    params = jax.tree.map(lambda a: np.asarray(a).astype(dtype), params)
  if isinstance(params, dict):
    params = _move_to_device(params)
  tmp = os.path.join(directory, _PARAMS + ".partial")
  shutil.rmtree(tmp, ignore_errors=True)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(os.path.abspath(tmp), params)
  os.replace(tmp, os.path.join(directory, _PARAMS))
  with open(os.path.join(directory, _CONFIG), "w") as f:
    f.write(config_gin)
  leaves = jax.tree.leaves(params)
  meta = {"format": FORMAT, "step": int(step), "source": source,
          "dtype": dtype or str(np.asarray(leaves[0]).dtype) if leaves else None,
          "num_params": int(sum(np.size(x) for x in leaves))}
  with open(os.path.join(directory, _META), "w") as f:
    json.dump(meta, f, indent=2)
  return directory


def _move_to_device(tree: Dict) -> Dict:
  """Replaces each numpy leaf of `tree` (nested dicts) by a device array in place,
  dropping the numpy reference leaf by leaf; returns `tree`. Orbax copies numpy
  leaves before writing, so handing it device arrays keeps the save's peak host
  memory near one copy of the model (measured at Base size: 9.7 -> 7.0 GiB)."""
  for key in list(tree):
    if isinstance(tree[key], dict):
      _move_to_device(tree[key])
    elif isinstance(tree[key], np.ndarray):
      tree[key] = jax.device_put(tree[key])
  return tree


def restore(directory: str, abstract_params: Any = None) -> Any:
  """Returns the exported params (into `abstract_params`' shapes, dtypes and
  shardings when given, else as saved on the default device)."""
  path = os.path.abspath(os.path.join(directory, _PARAMS))
  with ocp.StandardCheckpointer() as ckpt:
    return ckpt.restore(path, abstract_params)
