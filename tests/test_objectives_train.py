"""Tiny runs on the embedded corpus: each objective lowers its validation loss."""
import types

import gin
import pytest

from openmoe_jax import gin_utils
from openmoe_jax.trainer import train

TINY = ["ModelConfig.d_model = 32", "ModelConfig.num_heads = 2", "ModelConfig.head_dim = 16",
        "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 2", "MoeConfig.num_experts = 4",
        "MoeConfig.group_size = 64", "SEQUENCE_LENGTH = 64", "BATCH_SIZE = 8",
        "train.eval_batches = 2", "train.eval_every_steps = 1000",
        "train.log_every_steps = 1000", "train.checkpoint_every_steps = 1000",
        "adamw_warmup_cosine.warmup_steps = 2", "adamw_warmup_cosine.peak_lr = 1e-2",
        "TRAIN_STEPS = 20"]


@pytest.mark.slow
@pytest.mark.parametrize("gin_files,task", [
    ((), "local_mix"),
    (("objectives/ul2.gin",), "local_mix_ul2"),
    (("objectives/masked_diffusion.gin",), "local_mix"),
], ids=["causal_lm", "ul2", "masked_diffusion"])
def test_tiny_run_lowers_validation_loss(tmp_path, gin_files, task):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/quickstart.gin", *gin_files], TINY + [
      f"MODEL_DIR = '{tmp_path}'", f"MIXTURE_OR_TASK_NAME = '{task}'"])
  summary = train(print_fn=lambda *_: None)
  assert summary["last_eval_loss"] < summary["first_eval_loss"] - 0.5, summary


def test_per_layer_moe_metrics_use_model_layer_numbers():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from openmoe_jax.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from openmoe_jax.model import Decoder  # pylint: disable=g-import-not-at-top
  from openmoe_jax.objectives.common import moe_layer_numbers, moe_metrics  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(vocab_size=64, num_layers=4, sparse_interval=2)
  numbers = moe_layer_numbers(Decoder(cfg))
  assert numbers == [1, 3]  # what the analysis report calls them
  # A model without a ModelConfig (a test stub, a bare module): no numbers, so
  # moe_metrics counts the MoE layers instead.
  assert moe_layer_numbers(object()) is None
  assert moe_layer_numbers(types.SimpleNamespace(config={"num_layers": 4})) is None
  aux = {"aux_loss": 0.0, "lb_loss": 0.0, "z_loss": 0.0,
         "drop_fraction": jnp.array([0.1, 0.2]),
         "drop_fraction_first_quarter": jnp.array([0.0, 0.1]),
         "drop_fraction_last_quarter": jnp.array([0.3, 0.4]),
         "router_entropy": jnp.array([1.0, 1.0]),
         "expert_load": jnp.ones((2, 4))}
  metrics = moe_metrics(aux, numbers)
  assert float(metrics["moe/layer_3/drop_fraction"]) == pytest.approx(0.2)
  assert not any(k.startswith("moe/layer_0/") for k in metrics)
