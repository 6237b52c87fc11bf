"""A tiny UL2 training run on the embedded corpus (gin/runs/quickstart_ul2.gin)."""

import math

import gin
import pytest

from openmoe_jax import gin_utils
from openmoe_jax.trainer import train
from test_train import TINY_BINDINGS


@pytest.mark.slow
def test_tiny_ul2_run_has_finite_eval_loss(tmp_path):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/quickstart_ul2.gin"], TINY_BINDINGS + [
      f"MODEL_DIR = '{tmp_path}'", "TRAIN_STEPS = 3",
      "train.eval_every_steps = 3", "train.checkpoint_every_steps = 100",
      "adamw_warmup_cosine.warmup_steps = 1", "train.eval_batches = 1",
      "CausalLm.attention_kind = 'prefix'"])
  summary = train(print_fn=lambda *_: None)
  print("ul2 tiny run:", summary)
  assert summary["final_step"] == 3
  assert math.isfinite(summary["first_eval_loss"])
  assert math.isfinite(summary["last_eval_loss"])
