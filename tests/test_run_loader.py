"""Loading a params export like a run (run_loader.py, loading.py,
convert/params_export.py): the vocabulary from the config, the export's one step,
and the refusals that name what is wrong."""
import json
import os
import types

import numpy as np
import pytest

from openmoe_jax import errors, load_model, run_loader
from openmoe_jax.convert import params_export
from openmoe_jax.data import pipeline, vocabulary


def _export(directory, config_gin, step=7):
  params_export.save(str(directory), {"w": np.arange(4, dtype=np.float32)}, step,
                     config_gin, source="test")
  return str(directory)


def test_an_export_loads_with_the_vocabulary_its_config_binds(tmp_path):
  export = _export(tmp_path / "bound", "ModelConfig.vocab_size = 200\n")
  run = run_loader.load_run(export)
  assert run.steps == [7] and run.config.vocab_size == 200
  np.testing.assert_array_equal(run_loader.restore_params(export, 7)["w"], np.arange(4))
  with pytest.raises(ValueError, match=f"{export} is a params export of step 7, not 8"):
    run_loader.restore_params(export, 8)
  with pytest.raises(ValueError, match=rf"no checkpoint at step 8 in {export}: \[7\]"):
    load_model(export, step=8)


def test_an_export_without_a_vocabulary_or_of_another_format_is_refused(tmp_path):
  export = _export(tmp_path / "unbound", "")
  with pytest.raises(ValueError, match="binds neither train.mixture_or_task_name nor "
                     "ModelConfig.vocab_size: the vocabulary is unknown"):
    run_loader.load_run(export)
  meta_path = os.path.join(export, "export.json")
  with open(meta_path) as f:
    meta = json.load(f)
  with open(meta_path, "w") as f:
    json.dump(dict(meta, format="openmoe_jax.params/0"), f)
  with pytest.raises(ValueError, match="export.json: format 'openmoe_jax.params/0', "
                     "expected 'openmoe_jax.params/1'"):
    params_export.read_metadata(export)


def test_an_export_of_a_run_takes_the_vocabulary_of_its_task_and_default_shapes(
    tmp_path, monkeypatch):
  export = _export(tmp_path / "task", "train.mixture_or_task_name = 'local_text'\n")
  run = run_loader.load_run(export)
  vocab_size = pipeline.vocabulary_for("local_text").vocab_size  # 8292
  assert run.mixture_or_task_name == "local_text"
  assert run.config.vocab_size == 8320  # rounded up to a multiple of 128
  assert vocab_size <= 8320 < vocab_size + 128
  assert (run.sequence_length, run.batch_size) == (256, 8)  # train()'s defaults
  asked = []
  monkeypatch.setattr(run_loader.pipeline, "vocabulary_for",
                      lambda name: asked.append(name) or types.SimpleNamespace(
                          vocab_size=300))
  assert run_loader.load_run(export, vocab_task="local_code").config.vocab_size == 384
  assert asked == ["local_code"]


def _run(steps):
  return run_loader.Run(model_dir="/runs/x", config=None, mixture_or_task_name=None,
                        sequence_length=8, batch_size=2, steps=steps)


def test_pick_step_defaults_to_the_newest_and_names_the_available_steps():
  run = _run([2, 4, 6])
  assert run_loader.pick_step(run, None) == 6
  assert run_loader.pick_step(run, 4) == 4
  with pytest.raises(errors.InputError, match=r"^--step=5: /runs/x has no checkpoint at "
                     r"step 5; available steps: \[2, 4, 6\]$"):
    run_loader.pick_step(run, 5)
  with pytest.raises(errors.InputError, match=r"^--from_step=7: "):
    run_loader.pick_step(run, 7, flag="--from_step")


def test_check_task_takes_tasks_and_mixtures_and_suggests_the_closest_name():
  for name in ("local_text", "local_mix"):  # a task, a mixture
    assert run_loader.check_task(name, "--task") is None
  # Other tests register tasks of their own: the list is whatever is registered.
  with pytest.raises(errors.InputError) as error:
    run_loader.check_task("local_txt", "--task")
  assert str(error.value) == (
      "--task='local_txt' is no seqio task or mixture; did you mean 'local_text'? "
      "registered: " + ", ".join(run_loader.task_names()))
  with pytest.raises(errors.InputError) as error:
    run_loader.check_task(None, "--mix")
  assert str(error.value) == ("--mix=None is no seqio task or mixture; registered: "
                              + ", ".join(run_loader.task_names()))
  assert "local_code" in run_loader.task_names()


def test_check_split_names_the_valid_splits():
  assert run_loader.check_split("local_text", "validation") is None
  assert run_loader.check_split("no_such_task", "test") is None  # reading names it
  with pytest.raises(errors.InputError, match=r"^--split='test': local_text has no such "
                     r"split; valid: train, validation$"):
    run_loader.check_split("local_text", "test")


def test_the_mask_id_is_the_objectives_own_even_0_else_the_vocabularys():
  vocab = pipeline.vocabulary_for("local_text")
  mask = vocabulary.mask_token_id(vocab)
  assert mask not in (0, 3)
  objective = lambda mask_id: types.SimpleNamespace(mask_id=mask_id)
  assert run_loader.run_mask_id(objective(None), vocab) == mask
  assert run_loader.run_mask_id(objective(0), vocab) == 0
  assert run_loader.run_mask_id(objective(3), vocab) == 3
  assert run_loader.run_mask_id(object(), vocab) == mask  # a causal objective has none


def test_an_export_reads_as_a_run_once_a_run_has_saved_a_step_there(tmp_path):
  export = _export(tmp_path / "export", "ModelConfig.vocab_size = 200\n")
  reads_export = run_loader._reads_params_export  # pylint: disable=protected-access
  assert reads_export(export)
  os.makedirs(os.path.join(export, "checkpoints", "tmp"))  # no step saved yet
  assert reads_export(export)
  os.makedirs(os.path.join(export, "checkpoints", "12"))
  assert not reads_export(export)
  assert not reads_export(str(tmp_path))  # not an export at all
