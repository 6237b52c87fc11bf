"""The five-line way in: a model, its parameters and its vocabulary from a MODEL_DIR
or a params export.

  from openmoe_jax import load_model
  model, params, vocab = load_model("/tmp/openmoe_quickstart")
  tokens = jnp.asarray([vocab.encode("def add(a, b):")])
  logits, aux = model.apply({"params": params}, tokens)
"""
from typing import Any, NamedTuple, Optional

from openmoe_jax import run_loader
from openmoe_jax.data import pipeline
from openmoe_jax.model import Decoder


class LoadedModel(NamedTuple):
  """What `load_model` returns; unpacks as (model, params, vocabulary)."""

  model: Decoder
  params: Any
  vocabulary: Optional[Any]  # seqio.Vocabulary; None when the run names no task


def load_model(path: str, step: Optional[int] = None) -> LoadedModel:
  """Returns (Decoder, params, vocabulary) of the checkpoint at `step` (default: the
  newest) in `path`, a training MODEL_DIR or a params export. Parses the run's
  config.gin into the global gin config (cleared first)."""
  run = run_loader.load_run(path)
  step = run.steps[-1] if step is None else step
  if step not in run.steps:
    raise ValueError(f"no checkpoint at step {step} in {path}: {run.steps}")
  params = run_loader.restore_params(path, step)
  vocab = (pipeline.vocabulary_for(run.mixture_or_task_name)
           if run.mixture_or_task_name else None)
  return LoadedModel(Decoder(run.config), params, vocab)
