"""Parameter counts: a hand-computed tiny model and the OpenMoE presets."""
import gin
import pytest

from openmoe_jax import gin_utils, param_count
from openmoe_jax.cli import params as params_cli
from openmoe_jax.config import ModelConfig, MoeConfig


def test_tiny_model_counts_by_hand():
  d, f, v, e, k = 16, 24, 100, 4, 2
  cfg = ModelConfig(vocab_size=v, d_model=d, num_heads=2, head_dim=8, d_ff=f,
                    num_layers=2, sparse_interval=2, mlp_kind="swiglu",
                    moe=MoeConfig(num_experts=e, top_k=k, group_size=8))
  attention = 4 * d * 16
  mlp = 3 * d * f
  norms_per_layer = {False: 2 * d, True: 3 * d}  # attention, (moe,) mlp
  experts = e * mlp
  total = (2 * v * d + d + 2 * attention + 2 * mlp + experts + d * e
           + sum(norms_per_layer.values()))
  counts = param_count.count_params(cfg)
  assert counts["total"] == total
  assert counts["experts"] == experts
  assert counts["activated"] == total - (e - k) * mlp
  assert counts["embedding"] == 2 * v * d


def _preset(name, *bindings):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin([f"models/{name}.gin"], list(bindings), finalize=False)
  return param_count.count_params(ModelConfig())


def test_paper_counts_follow_from_standard_swiglu_and_one_vocab_table():
  # The paper counts 3*d*d_ff per MLP and one 256,384 x d table; Base with MLP 3072.
  swiglu = "ModelConfig.mlp_kind = 'swiglu'"
  base = _preset("openmoe_base_16e", swiglu, "ModelConfig.d_ff = 3072")
  assert base["total"] - 256384 * 768 == pytest.approx(650e6, rel=0.01)
  big = _preset("openmoe_8b_32e", swiglu)
  assert big["total"] - 256384 * 2048 == pytest.approx(8.7e9, rel=0.02)
  assert big["activated_non_embedding"] == pytest.approx(2.1e9, rel=0.06)


def test_cli_prints_counts(capsys):
  assert params_cli.main(["--gin_file=models/openmoe_8b_32e.gin"]) == 0
  out = capsys.readouterr().out
  assert "total 11.855B" in out and "activated 3.802B" in out
  assert params_cli.main([]) == 2
  assert "--gin_file is required" in capsys.readouterr().err
