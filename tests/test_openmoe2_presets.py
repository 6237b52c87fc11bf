"""The OpenMoE 2 routing-ablation presets configure what their names say."""
import gin
import pytest

from openmoe_jax import gin_utils
from openmoe_jax.config import ModelConfig
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter


def _model(name):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin([f"experiments/openmoe2/{name}.gin"], finalize=False)
  return ModelConfig()


def _active_width(cfg):
  moe = cfg.moe
  return moe.top_k * cfg.expert_d_ff + moe.num_shared_experts * (
      moe.shared_expert_d_ff or cfg.expert_d_ff)


@pytest.mark.parametrize("name,router_cls,check", [
    ("tc_softmax", TokenChoiceRouter, lambda m: m.gate == "softmax"),
    ("tc_dropless", TokenChoiceRouter, lambda m: m.router.dropless),
    ("tc_sigmoid", TokenChoiceRouter, lambda m: m.gate == "sigmoid"),
    ("tc_scaling", TokenChoiceRouter, lambda m: m.routed_scaling_factor == 2.5),
    ("ec_batch", ExpertChoiceRouter,
     lambda m: m.router.level == "batch" and m.tokenwise_lb_loss_weight == 0),
    ("ec_sequence", ExpertChoiceRouter, lambda m: m.router.level == "sequence"),
    ("ec_tokenwise_lb", ExpertChoiceRouter, lambda m: m.tokenwise_lb_loss_weight > 0),
    ("ec_scaling", ExpertChoiceRouter,
     lambda m: len(m.router.count_scaling_factors) == m.num_experts + 1),
    ("shared_always_on", TokenChoiceRouter,
     lambda m: m.num_shared_experts == 1 and not m.shared_experts_gated),
    ("shared_gated", TokenChoiceRouter, lambda m: m.shared_experts_gated),
    ("granularity_64", TokenChoiceRouter, lambda m: m.num_experts == 64),
])
def test_arm_sets_its_option_at_equal_active_width(name, router_cls, check):
  cfg = _model(name)
  assert isinstance(cfg.moe.router, router_cls)
  assert check(cfg.moe)
  assert _active_width(cfg) == cfg.d_ff == 512


def test_dense_first_arm_layout():
  assert _model("dense_first2").sparse_layers() == (False, False, True, True)
  assert _model("tc_softmax").sparse_layers() == (True,) * 4
