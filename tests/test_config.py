"""ModelConfig / MoeConfig refuse impossible values by name, and
build_model_config fills in or checks the vocabulary size."""
import pytest

from openmoe_jax.config import ModelConfig, MoeConfig, build_model_config


@pytest.mark.parametrize("changes,message", [
    ({"num_shared_experts": -1}, "MoeConfig.num_shared_experts must be >= 0"),
    ({"group_size": 0}, "MoeConfig: group_size must be >= 1 and min_capacity >= 0"),
    ({"min_capacity": -1}, "MoeConfig: group_size must be >= 1 and min_capacity >= 0"),
    ({"num_experts": 0, "top_k": 0}, r"need 1 <= top_k \(0\) <= num_experts \(0\)"),
    ({"capacity_factor_eval": 0.0}, "MoeConfig.capacity_factor_eval=0.0 must be > 0"),
    ({"group_size": 2.0}, "MoeConfig.group_size=2.0 must be an int"),
])
def test_moe_config_refuses(changes, message):
  with pytest.raises(ValueError, match=message):
    MoeConfig(**changes)


@pytest.mark.parametrize("changes,message", [
    *(({name: 0}, f"ModelConfig.{name}=0 must be >= 1")
      for name in ("d_model", "num_heads", "head_dim", "d_ff")),
    ({"vocab_size": 0}, "ModelConfig.vocab_size=0 must be >= 1"),
    ({"remat_policy": "some"}, "ModelConfig.remat_policy='some'; choose one of"),
    ({"dtype": "float64"}, "ModelConfig.dtype='float64'; choose one of"),
    *(({name: value}, "ModelConfig: num_layers >= 1, sparse_interval >= 0, "
       "num_dense_first >= 0 required")
      for name, value in (("num_layers", 0), ("sparse_interval", -1),
                          ("num_dense_first", -1))),
    ({"head_dim": 7}, "ModelConfig.head_dim must be even for RoPE, got 7"),
    ({"d_model": True}, "ModelConfig.d_model=True must be an int"),
])
def test_model_config_refuses(changes, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig(**changes)


def test_the_smallest_valid_values_are_taken():
  MoeConfig(num_experts=1, top_k=1, group_size=1, min_capacity=0,
            num_shared_experts=0)
  ModelConfig(d_model=1, num_heads=1, head_dim=2, d_ff=1, vocab_size=1, num_layers=1,
              sparse_interval=0, num_dense_first=0)


def test_build_model_config_rounds_the_task_vocabulary_up_or_checks_a_given_size():
  assert build_model_config(ModelConfig(), 300).vocab_size == 384  # 3 x 128
  assert build_model_config(ModelConfig(), 256).vocab_size == 256
  assert build_model_config(ModelConfig(vocab_size=300), 300).vocab_size == 300
  with pytest.raises(ValueError, match=r"ModelConfig.vocab_size=299 is smaller than "
                     r"the task vocabulary \(300\)"):
    build_model_config(ModelConfig(vocab_size=299), 300)


@pytest.mark.parametrize("fields, expected", [
    # Every second layer from the first: layers 1, 3, 5 (OpenMoE's interval 2).
    (dict(num_layers=6, sparse_interval=2), [1, 3, 5]),
    # Interval 3 after 3 dense first layers: 2 is dense, then 5 and 8.
    (dict(num_layers=9, sparse_interval=3, num_dense_first=3), [5, 8]),
    (dict(num_layers=6, layer_pattern="DMDDMM"), [1, 4, 5]),
    (dict(num_layers=3, sparse_interval=0), []),
])
def test_moe_layer_numbers_count_from_zero_in_layer_order(fields, expected):
  cfg = ModelConfig(**fields)
  assert cfg.moe_layer_numbers() == expected
