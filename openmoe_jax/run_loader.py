"""Loading a trained run (analysis, sampling, evaluation): its gin config, model
config and checkpoints. A params export (`convert/params_export.py`) loads the same
way: its one step is the export's."""
import dataclasses
import os
from typing import Any, List, Optional

import gin

from openmoe_jax import gin_utils
from openmoe_jax.checkpoints import Checkpointer
from openmoe_jax.config import ModelConfig, build_model_config
from openmoe_jax.convert import params_export
from openmoe_jax.data import pipeline, vocabulary


@dataclasses.dataclass
class Run:
  """A MODEL_DIR's model config, training settings and checkpoint steps."""

  model_dir: str
  config: ModelConfig
  mixture_or_task_name: Optional[str]
  sequence_length: int
  batch_size: int
  steps: List[int]


def query(name: str, default: Any = None) -> Any:
  """Returns the bound value of `name` (macros resolved), or `default` if unbound."""
  try:
    value = gin.query_parameter(name)
  except ValueError:
    return default
  if isinstance(value, gin.config.ConfigurableReference):
    value = value.scoped_configurable_fn()
  return value


def run_mask_id(objective: Any, vocab: Any) -> int:
  """Returns the diffusion mask token id of a run: its objective's `mask_id` when set
  (gin-bound; 0 is a valid id), else the `<mask>` token of `vocab`."""
  mask_id = getattr(objective, "mask_id", None)
  return vocabulary.mask_token_id(vocab) if mask_id is None else int(mask_id)


def load_run(model_dir: str, vocab_task: Optional[str] = None) -> Run:
  """Returns the Run in `model_dir` (a training MODEL_DIR or a params export),
  parsing its `config.gin` into the global gin config (cleared first). The
  vocabulary comes from `vocab_task` (default: the run's own mixture or task; a
  model that binds ModelConfig.vocab_size needs none)."""
  path = os.path.join(model_dir, "config.gin")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: is {model_dir} a training MODEL_DIR "
                            "or a params export?")
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin([path], finalize=False)
  mixture = query("train.mixture_or_task_name")
  if _reads_params_export(model_dir):
    steps = [params_export.read_metadata(model_dir)["step"]]
  else:
    steps = Checkpointer(model_dir).all_steps()
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {model_dir}/checkpoints")
  if vocab_task or mixture:
    vocab_size = pipeline.vocabulary_for(vocab_task or mixture).vocab_size
  elif query("ModelConfig.vocab_size"):
    vocab_size = query("ModelConfig.vocab_size")
  else:
    raise ValueError(f"{path} binds neither train.mixture_or_task_name nor "
                     "ModelConfig.vocab_size: the vocabulary is unknown")
  return Run(model_dir=model_dir, config=build_model_config(None, vocab_size),
             mixture_or_task_name=mixture,
             sequence_length=int(query("train.sequence_length", 256)),
             batch_size=int(query("train.batch_size", 8)), steps=steps)


def _reads_params_export(model_dir: str) -> bool:
  """Returns whether `model_dir` is a params export no run has trained on yet (once
  `openmoe-train` has saved checkpoints there, those are the run's)."""
  checkpoints = os.path.join(model_dir, "checkpoints")
  return params_export.is_params_export(model_dir) and not (
      os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints)))


def restore_params(model_dir: str, step: int) -> Any:
  """Returns the model parameters saved at `step` (arrays as saved, default device)."""
  if _reads_params_export(model_dir):
    saved = params_export.read_metadata(model_dir)["step"]
    if step != saved:
      raise ValueError(f"{model_dir} is a params export of step {saved}, not {step}")
    return params_export.restore(model_dir)
  ckpt = Checkpointer(model_dir)
  try:
    state, _ = ckpt.restore(step)
  finally:
    ckpt.close()
  return state["params"]
