"""Loading a trained run (analysis, sampling): its gin config, model config, checkpoints."""
import dataclasses
import os
from typing import Any, List, Optional

import gin

from openmoe_jax import gin_utils
from openmoe_jax.checkpoints import Checkpointer
from openmoe_jax.config import ModelConfig
from openmoe_jax.data import pipeline, vocabulary
from openmoe_jax.trainer import build_model_config


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
  """Returns the Run in `model_dir`, parsing its operative `config.gin` into the
  global gin config (cleared first). The vocabulary comes from `vocab_task`
  (default: the run's own mixture or task)."""
  path = os.path.join(model_dir, "config.gin")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: is {model_dir} a training MODEL_DIR?")
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin([path], finalize=False)
  mixture = query("train.mixture_or_task_name")
  vocab = pipeline.vocabulary_for(vocab_task or mixture)
  steps = Checkpointer(model_dir).all_steps()
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {model_dir}/checkpoints")
  return Run(model_dir=model_dir, config=build_model_config(None, vocab.vocab_size),
             mixture_or_task_name=mixture,
             sequence_length=int(query("train.sequence_length", 256)),
             batch_size=int(query("train.batch_size", 8)), steps=steps)


def restore_params(model_dir: str, step: int) -> Any:
  """Returns the model parameters saved at `step` (arrays as saved, default device)."""
  ckpt = Checkpointer(model_dir)
  try:
    state, _ = ckpt.restore(step)
  finally:
    ckpt.close()
  return state["params"]
