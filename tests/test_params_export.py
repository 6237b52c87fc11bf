"""Params exports (openmoe-convert params): a training MODEL_DIR exported bit-exactly,
training that continues from an export, and the export folder's rules."""
import json
import os
import re
import shutil

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax import gin_utils, load_model
from openmoe_jax.checkpoints import Checkpointer
from openmoe_jax.cli import convert as convert_cli
from openmoe_jax.config import ModelConfig
from openmoe_jax.convert import params_export
from openmoe_jax.model import Decoder
from openmoe_jax.trainer import TrainState
from test_convert import GIN, _convert


def test_params_export_of_a_training_dir_loads_bit_exactly(tmp_path, capsys):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin([GIN[0].split("=", 1)[1]],
                      [a[len("--gin."):].replace("=", " = ", 1) for a in GIN[1:]],
                      finalize=False)
  cfg = ModelConfig()
  params = nn.unbox(Decoder(cfg).init(jax.random.PRNGKey(3),
                                      jnp.zeros((1, 8), jnp.int32))["params"])
  run = tmp_path / "run"
  with Checkpointer(str(run)) as ckpt:
    ckpt.save(5, TrainState(step=np.asarray(5, np.int32), params=params,
                            opt_state={}), force=True)
  (run / "config.gin").write_text(gin.config_str())
  export = str(tmp_path / "export")
  _convert("params", f"--model_dir={run}", f"--output={export}")
  _, restored, _ = load_model(export)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b),
               params, restored)
  half = str(tmp_path / "bf16")
  # As the console program: exit 0, the step it exported, the seconds it took.
  capsys.readouterr()
  assert convert_cli.main(["params", f"--model_dir={run}", f"--output={half}",
                           "--dtype=bfloat16"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == f"Wrote the params export of step 5 (4 layers) to {half}"
  seconds = re.fullmatch(r"Done in (\d+\.\d) s", lines[-1])
  assert seconds and 0 <= float(seconds.group(1)) < 600, lines
  _, restored, _ = load_model(half)
  assert {str(x.dtype) for x in jax.tree.leaves(restored)} == {"bfloat16"}


@pytest.mark.slow
def test_training_continues_from_a_params_export(tmp_path):
  """A params export is a MODEL_DIR openmoe-train starts from: its parameters, its
  step, a fresh optimizer state; then its own checkpoints take over."""
  from test_train import TINY_BINDINGS  # pylint: disable=g-import-not-at-top
  from openmoe_jax.trainer import train  # pylint: disable=g-import-not-at-top

  def configure(model_dir, steps):
    gin.clear_config()
    gin_utils.import_configurables()
    gin_utils.parse_gin(["runs/quickstart.gin"], TINY_BINDINGS + [
        f"MODEL_DIR = '{model_dir}'", f"TRAIN_STEPS = {steps}",
        "train.eval_every_steps = 100", "train.checkpoint_every_steps = 100",
        "adamw_warmup_cosine.warmup_steps = 1", "adamw_warmup_cosine.total_steps = 4"])

  run, export = str(tmp_path / "run"), str(tmp_path / "export")
  configure(run, 2)
  train(print_fn=lambda *_: None)
  _convert("params", f"--model_dir={run}", f"--output={export}")
  from openmoe_jax.cli import evaluate, sample  # pylint: disable=g-import-not-at-top
  # Both read the export as a MODEL_DIR.
  assert evaluate.main([f"--model_dir={export}", "--num_batches=1"]) == 0
  assert sample.main([f"--model_dir={export}", "--max_new_tokens=2"]) == 0
  configure(export, 4)
  lines = []
  summary = train(print_fn=lines.append)
  assert any("Starting from the params export" in l and "step 2" in l for l in lines)
  assert (summary["start_step"], summary["final_step"]) == (2, 4)
  _, params, _ = load_model(export)  # now the run's own step-4 checkpoint
  _, exported, _ = load_model(run)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(
      np.asarray(a) - np.asarray(b)).max()), params, exported))
  # The fresh optimizer state restarts the schedule (warmup: lr 0 at its first
  # step), so the second step moves the exported parameters.
  assert max(moved) > 0
  # Steps 3 and 4 drew the first two batches of the data: a resume skips those two.
  with open(os.path.join(export, "checkpoints", "4", "data_position", "metadata")) as f:
    assert json.load(f)["train_batches"] == 2


def test_an_export_is_never_overwritten_and_needs_both_parts(tmp_path):
  """A folder counts as a params export only with both export.json and params/;
  saving into one that holds an export raises FileExistsError and leaves the
  first export as it was."""
  out = str(tmp_path / "export")
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
  params_export.save(out, dict(params), step=4, config_gin="", source="first")
  assert params_export.is_params_export(out)
  with pytest.raises(FileExistsError):
    params_export.save(out, {"w": np.zeros((2, 3), np.float32)}, step=9,
                       config_gin="", source="second")
  assert params_export.read_metadata(out)["step"] == 4
  np.testing.assert_array_equal(np.asarray(params_export.restore(out)["w"]), params["w"])
  meta_only, params_only = tmp_path / "meta_only", tmp_path / "params_only"
  shutil.copytree(out, meta_only, ignore=shutil.ignore_patterns("params"))
  shutil.copytree(out, params_only, ignore=shutil.ignore_patterns("export.json"))
  assert not params_export.is_params_export(str(meta_only))
  assert not params_export.is_params_export(str(params_only))


def test_export_json_records_the_dtype_and_an_empty_output_folder_is_used(tmp_path):
  """export.json says the dtype written: the parameters' own, or the one cast to; an
  --output folder made beforehand (empty) is fine."""
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3)}
  as_is, cast = tmp_path / "as_is", tmp_path / "cast"
  cast.mkdir()
  params_export.save(str(as_is), {"w": params["w"]}, step=1, config_gin="", source="a")
  params_export.save(str(cast), dict(params), step=2, config_gin="", source="b",
                     dtype="bfloat16")
  assert params_export.read_metadata(str(as_is))["dtype"] == "float32"
  meta = params_export.read_metadata(str(cast))
  assert meta["dtype"] == "bfloat16" and meta["num_params"] == 9 and meta["step"] == 2
  assert {str(np.asarray(x).dtype) for x in jax.tree.leaves(
      params_export.restore(str(cast)))} == {"bfloat16"}
