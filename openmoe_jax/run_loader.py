"""Loading a trained run (analysis, sampling, evaluation): its gin config, model
config and checkpoints. A params export (`convert/params_export.py`) loads the same
way: its one step is the export's."""
import dataclasses
import difflib
import os
from typing import Any, List, Optional

import gin
import seqio

from openmoe_jax import errors, gin_utils, tasks
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


def pick_step(run: Run, step: Optional[int], flag: str = "--step") -> int:
  """Returns `step` (None: the run's newest); raises errors.InputError naming the
  flag and the available steps when the run has no checkpoint at `step`."""
  if step is None:
    return run.steps[-1]
  if step not in run.steps:
    raise errors.InputError(f"{flag}={step}: {run.model_dir} has no checkpoint at step "
                            f"{step}; available steps: {run.steps}")
  return step


def task_names() -> List[str]:
  """Returns the names of every registered seqio task and mixture, sorted."""
  tasks.register_tasks()
  return sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))


def check_task(name: Any, flag: str) -> None:
  """Raises errors.InputError naming `flag`, the closest registered name and the
  valid ones when `name` is no registered seqio task or mixture; returns None."""
  names = task_names()
  if isinstance(name, str) and name in names:
    return
  close = difflib.get_close_matches(str(name), names, n=1)
  hint = f"did you mean {close[0]!r}? " if close else ""
  raise errors.InputError(f"{flag}={name!r} is no seqio task or mixture; {hint}"
                          f"registered: {', '.join(names)}")


def check_split(name: str, split: str, flag: str = "--split") -> None:
  """Raises errors.InputError naming `flag` and the valid splits when the task or
  mixture `name` has no split `split`; returns None (also for a name seqio does not
  know: reading its data names that)."""
  if name not in task_names():
    return
  splits = sorted(seqio.get_mixture_or_task(name).splits)
  if split not in splits:
    raise errors.InputError(f"{flag}={split!r}: {name} has no such split; valid: "
                            f"{', '.join(splits)}")


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
