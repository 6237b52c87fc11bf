"""Loading a params export like a run (run_loader.py, loading.py,
convert/params_export.py): the vocabulary from the config, the export's one step,
and the refusals that name what is wrong."""
import json
import os

import numpy as np
import pytest

from openmoe_jax import load_model, run_loader
from openmoe_jax.convert import params_export


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
