"""OpenMoE 2 at released scale: presets, QK-norm and the WSD learning rate."""
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax import gin_utils, param_count
from openmoe_jax.config import ModelConfig
from openmoe_jax.layers.attention import Attention
from openmoe_jax.optim import wsd_schedule


def _model(name):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin([f"models/{name}.gin"], finalize=False)
  return ModelConfig()


def test_dense_1p7b_and_moe_8b_a1p7b_counts():
  dense, moe = _model("openmoe2_dense_1p7b"), _model("openmoe2_moe_8b_a1p7b")
  assert (dense.num_layers, dense.d_model, dense.num_heads, dense.d_ff) == (
      28, 2048, 16, 6144)
  assert dense.qk_norm and not any(dense.sparse_layers()) and all(moe.sparse_layers())
  dense_counts, moe_counts = param_count.count_params(dense), param_count.count_params(moe)
  assert dense_counts["total"] == pytest.approx(1.733e9, rel=1e-3)
  # Active width top_k x expert_d_ff equals the dense FFN: the activated count is the
  # dense model's plus the routers.
  assert moe.moe.top_k * moe.expert_d_ff == dense.d_ff
  router = moe.num_layers * moe.d_model * moe.moe.num_experts
  assert moe_counts["activated"] == dense_counts["total"] + router
  assert moe_counts["total"] == pytest.approx(9.135e9, rel=1e-3)
  # Upcyclable: d_ff / expert_d_ff slices divide the experts.
  assert moe.moe.num_experts % (dense.d_ff // moe.expert_d_ff) == 0


def test_qk_norm_makes_attention_invariant_to_query_and_key_scale():
  attention = Attention(num_heads=2, head_dim=8, qk_norm=True)
  x_btd = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 16))
  positions_bt = jnp.broadcast_to(jnp.arange(5), (2, 5))
  mask_b1tt = jnp.tril(jnp.ones((5, 5), bool))[None, None]
  params = nn.unbox(attention.init(jax.random.PRNGKey(1), x_btd, positions_bt,
                                   mask_b1tt)["params"])
  assert params["query_norm"]["scale"].shape == (8,)
  out = attention.apply({"params": params}, x_btd, positions_bt, mask_b1tt)
  scaled = dict(params, query=params["query"] * 7.0, key=params["key"] * 0.3)
  np.testing.assert_allclose(
      attention.apply({"params": scaled}, x_btd, positions_bt, mask_b1tt), out,
      rtol=1e-4, atol=1e-5)
  plain = Attention(num_heads=2, head_dim=8)
  plain_params = {k: params[k] for k in ("query", "key", "value", "out")}
  plain_scaled = dict(plain_params, query=params["query"] * 7.0)
  assert not np.allclose(plain.apply({"params": plain_scaled}, x_btd, positions_bt,
                                     mask_b1tt),
                         plain.apply({"params": plain_params}, x_btd, positions_bt,
                                     mask_b1tt), atol=1e-3)


def test_wsd_schedule():
  lr = wsd_schedule(2e-4, warmup_steps=10, total_steps=100, decay_fraction=0.2,
                    end_lr=2e-5)
  values = [float(lr(s)) for s in (0, 5, 10, 50, 80, 90, 100, 150)]
  np.testing.assert_allclose(values, [0, 1e-4, 2e-4, 2e-4, 2e-4, 1.1e-4, 2e-5, 2e-5],
                             rtol=1e-5, atol=1e-12)
  with pytest.raises(ValueError, match="decay_fraction"):
    wsd_schedule(1e-3, warmup_steps=90, total_steps=100, decay_fraction=0.2)
