"""The einsum MoE layer against the slow loop reference (moe/reference.py)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.config import MoeConfig
from openmoe_jax.moe.layer import MoeLayer, group_tokens
from openmoe_jax.moe.reference import reference_moe


def _run(cfg, kind, train, b=2, t=16, d=8, d_ff=12, seed=0):
  layer = MoeLayer(cfg, kind, d_ff)
  x_btd = jax.random.normal(jax.random.PRNGKey(seed), (b, t, d))
  params = nn.unbox(jax.jit(lambda r, x: layer.init(r, x, train=train))(
      jax.random.PRNGKey(seed + 1), x_btd))
  y_btd, aux = jax.jit(lambda p, x: layer.apply(p, x, train=train))(params, x_btd)
  p = params["params"]
  expected, dropped = reference_moe(
      x_btd, p["router"]["w"], p["experts"]["wi_0"], p["experts"]["wi_1"],
      p["experts"]["wo"], cfg, kind, train)
  return y_btd, aux, expected, dropped


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "openmoe_swiglu"])
@pytest.mark.parametrize("train", [True, False])
def test_einsum_layer_matches_loop_reference(kind, train):
  # A large router init skews routing so that experts overflow at factor 0.5.
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=16, capacity_factor_train=0.5,
                  capacity_factor_eval=1.0, min_capacity=1, router_init_std=2.0)
  y_btd, aux, expected, dropped = _run(cfg, kind, train)
  assert dropped > 0.05, "test must exercise overflowing experts"
  np.testing.assert_allclose(np.asarray(y_btd), expected, rtol=2e-4, atol=2e-5)
  assert float(aux["drop_fraction"]) == pytest.approx(dropped)


def test_no_drops_with_ample_capacity_and_renormalised_gates():
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=32, capacity_factor_train=8.0,
                  renormalize_gates=True, router_init_std=1.0)
  y_btd, aux, expected, dropped = _run(cfg, "swiglu", True)
  assert dropped == 0 and float(aux["drop_fraction"]) == 0
  np.testing.assert_allclose(np.asarray(y_btd), expected, rtol=2e-4, atol=2e-5)


def test_top1_and_top3_match_reference():
  for k in (1, 3):
    cfg = MoeConfig(num_experts=4, top_k=k, group_size=8, capacity_factor_train=1.0,
                    min_capacity=1, router_init_std=1.5)
    y_btd, _, expected, _ = _run(cfg, "swiglu", True, seed=k)
    np.testing.assert_allclose(np.asarray(y_btd), expected, rtol=2e-4, atol=2e-5)


def test_dropped_tokens_get_zero_expert_output():
  # Capacity 1 for 16 tokens on 2 experts: at most 2 tokens are served per group.
  cfg = MoeConfig(num_experts=2, top_k=1, group_size=16, capacity_factor_train=0.1,
                  min_capacity=1)
  y_btd, aux, _, _ = _run(cfg, "swiglu", True, b=1)
  served = np.sum(np.any(np.asarray(y_btd) != 0, axis=-1))
  assert served <= 2
  assert float(aux["drop_fraction"]) >= 14 / 16


def test_group_tokens_rejects_indivisible_group():
  with pytest.raises(ValueError, match="group_size"):
    group_tokens(jnp.zeros((2, 10, 4)), 6)
  assert group_tokens(jnp.zeros((2, 10, 4)), 4096).shape == (1, 20, 4)


def test_late_drop_fraction_and_sown_routing_match_a_direct_count():
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=16, capacity_factor_train=0.5,
                  min_capacity=1, router_init_std=2.0)
  layer = MoeLayer(cfg, "swiglu", 12)
  x_btd = jax.random.normal(jax.random.PRNGKey(7), (2, 16, 8))
  params = layer.init(jax.random.PRNGKey(8), x_btd, train=True)
  (_, aux), state = layer.apply(params, x_btd, train=True, mutable=["intermediates"])
  routing = state["intermediates"]["routing"][0]
  kept_btk = np.asarray(routing["kept"])
  assert kept_btk.shape == (2, 16, 2)
  assert float(aux["drop_fraction"]) == pytest.approx(1 - kept_btk.mean())
  assert float(aux["drop_fraction_last_quarter"]) == pytest.approx(
      1 - kept_btk[:, 12:].mean())
  gates = np.asarray(routing["gates"])
  assert np.all(gates[~kept_btk] == 0) and np.all(gates[kept_btk] > 0)
