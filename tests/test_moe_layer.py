"""The einsum MoE layer against the slow loop reference (tests/moe_reference.py)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.config import MoeConfig
from openmoe_jax.moe.layer import MoeLayer, group_tokens
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter

from moe_reference import reference_mlp, reference_moe


def _run(cfg, kind, train, b=2, t=16, d=8, d_ff=12, seed=0):
  return _run_any(cfg, train, b, t, d, d_ff, seed, kind)[:4]


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


@pytest.mark.parametrize("std", [None, 0.5])
def test_router_weights_start_from_router_init_std(std):
  # normal(router_init_std) (REFERENCE.md: normal(0.02), the default); 512 x 16
  # draws put the sample std within 3% of it.
  cfg = MoeConfig(num_experts=16) if std is None else MoeConfig(num_experts=16,
                                                                router_init_std=std)
  params = MoeLayer(cfg, "swiglu", 8).init(jax.random.PRNGKey(0),
                                           jnp.zeros((1, 16, 512)), train=False)
  w = np.asarray(nn.unbox(params["params"]["router"]["w"]))
  assert w.shape == (512, 16) and w.dtype == np.float32
  assert abs(float(w.mean())) < 0.1 * (std or 0.02)
  assert float(w.std()) == pytest.approx(std or 0.02, rel=0.03)


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


def _sown_routing(cfg):
  """Returns (aux, sown routing dict) of a layer applied to a fixed [2, 16, 8] input."""
  layer = MoeLayer(cfg, "swiglu", 12)
  x_btd = jax.random.normal(jax.random.PRNGKey(7), (2, 16, 8))
  params = layer.init(jax.random.PRNGKey(8), x_btd, train=True)
  (_, aux), state = layer.apply(params, x_btd, train=True, mutable=["intermediates"])
  return aux, state["intermediates"]["routing"][0]


def test_late_drop_fraction_and_sown_routing_match_a_direct_count():
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=16, capacity_factor_train=0.5,
                  min_capacity=1, router_init_std=2.0)
  aux, routing = _sown_routing(cfg)
  kept_btk = np.asarray(routing["kept"])
  assert kept_btk.shape == (2, 16, 2)
  assert float(aux["drop_fraction"]) == pytest.approx(1 - kept_btk.mean())
  assert float(aux["drop_fraction_last_quarter"]) == pytest.approx(
      1 - kept_btk[:, 12:].mean())
  assert float(aux["drop_fraction_first_quarter"]) == pytest.approx(
      1 - kept_btk[:, :4].mean())
  gates = np.asarray(routing["gates"])
  assert np.all(gates[~kept_btk] == 0) and np.all(gates[kept_btk] > 0)


# --- Router options, expert choice and shared experts through the whole layer -------


def _shared_params(p):
  """Returns the reference's `shared` dict from layer params (None without)."""
  if "shared_experts" not in p:
    return None
  shared = dict(p["shared_experts"])
  if "w_shared" in p["router"]:
    shared["w_shared"] = p["router"]["w_shared"]
  return shared


def _run_any(cfg, train=True, b=2, t=16, d=8, d_ff=12, seed=0, kind="swiglu"):
  layer = MoeLayer(cfg, kind, d_ff)
  x_btd = jax.random.normal(jax.random.PRNGKey(seed), (b, t, d))
  params = nn.unbox(jax.jit(lambda r, x: layer.init(r, x, train=train))(
      jax.random.PRNGKey(seed + 1), x_btd))
  y_btd, aux = jax.jit(lambda p, x: layer.apply(p, x, train=train))(params, x_btd)
  p = params["params"]
  expected, dropped = reference_moe(
      x_btd, p["router"]["w"], p["experts"]["wi_0"], p["experts"]["wi_1"],
      p["experts"]["wo"], cfg, kind, train, shared=_shared_params(p))
  return y_btd, aux, expected, dropped, params, x_btd


LAYER_CASES = {
    "dropless_top3": dict(top_k=3, router=TokenChoiceRouter(dropless=True)),
    "bpr_sigmoid_renorm_scaled": dict(router=TokenChoiceRouter(batch_prioritized=True),
                                      gate="sigmoid", renormalize_gates=True,
                                      routed_scaling_factor=2.0),
    "position_major_top3": dict(top_k=3,
                                router=TokenChoiceRouter(priority="position_major")),
    # OpenMoE 2's token choice: cf x k x T / E buffers, renormalised top-k gates.
    "capacity_per_choice_top3": dict(top_k=3, renormalize_gates=True,
                                     router=TokenChoiceRouter(capacity_per_choice=True)),
    "expert_choice_batch": dict(router=ExpertChoiceRouter(), capacity_factor_train=1.0),
    "expert_choice_sequence_counts": dict(
        router=ExpertChoiceRouter(level="sequence",
                                  count_scaling_factors=(0.0, 1.0, 0.7, 0.6, 0.5)),
        gate="sigmoid", renormalize_gates=True, capacity_factor_train=1.0),
    "shared_always_on": dict(num_shared_experts=2, shared_expert_d_ff=6),
    "shared_gated_expert_choice": dict(num_shared_experts=1, shared_experts_gated=True,
                                       router=ExpertChoiceRouter(level="sequence"),
                                       capacity_factor_train=1.0),
}


@pytest.mark.parametrize("name", sorted(LAYER_CASES))
def test_layer_with_router_options_matches_loop_reference(name):
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=32, capacity_factor_train=0.5,
                  min_capacity=1, router_init_std=2.0).replace(**LAYER_CASES[name])
  y_btd, aux, expected, dropped, _, _ = _run_any(cfg)
  np.testing.assert_allclose(np.asarray(y_btd), expected, rtol=2e-4, atol=2e-5)
  assert float(aux["drop_fraction"]) == pytest.approx(dropped)
  if name.startswith("dropless"):
    assert dropped == 0
  elif name.endswith("top3"):
    assert dropped > 0.1, "the case must overflow experts"


def test_expert_choice_sown_routing_has_one_option_per_expert():
  cfg = MoeConfig(num_experts=4, top_k=1, group_size=32, capacity_factor_train=1.0,
                  router=ExpertChoiceRouter(level="sequence"), router_init_std=2.0)
  aux, routing = _sown_routing(cfg)
  kept = np.asarray(routing["kept"])
  assert kept.shape == (2, 16, 4)
  np.testing.assert_array_equal(routing["expert_index"][1, 3], np.arange(4))
  np.testing.assert_array_equal(kept.sum(axis=1), np.full((2, 4), 4))  # C per sequence
  assert float(aux["no_expert_fraction"]) == pytest.approx(np.mean(~kept.any(-1)))
  assert float(aux["drop_fraction_last_quarter"]) == pytest.approx(
      np.mean(~kept[:, 12:].any(-1)))
  assert float(aux["lb_loss"]) == 0 and float(aux["tokenwise_lb_loss"]) > 0


@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_alone_when_routed_outputs_are_zeroed(gated):
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=32, num_shared_experts=2,
                  shared_expert_d_ff=6, shared_experts_gated=gated)
  _, _, _, _, params, x_btd = _run_any(cfg)
  p = jax.tree.map(lambda a: a, params["params"])
  p["experts"] = dict(p["experts"], wo=jnp.zeros_like(p["experts"]["wo"]))
  y_btd, _ = MoeLayer(cfg, "swiglu", 12).apply({"params": p}, x_btd, train=True)
  if gated:  # separate router rows, not a slice of the routed ones
    assert p["router"]["w_shared"].shape == (8, 2) and p["router"]["w"].shape == (8, 4)
  else:
    assert "w_shared" not in p["router"]
  x_nd = np.asarray(x_btd, np.float64).reshape(-1, 8)
  expected = np.zeros_like(x_nd)
  sp = {k: np.asarray(v, np.float64) for k, v in p["shared_experts"].items()}
  logits = x_nd @ np.concatenate([p["router"]["w"], p["router"].get(
      "w_shared", np.zeros((8, 0)))], axis=1)
  joint = np.exp(logits - logits.max(-1, keepdims=True))
  joint /= joint.sum(-1, keepdims=True)
  for i, x_d in enumerate(x_nd):
    for j in range(2):
      gate = joint[i, 4 + j] if gated else 1.0
      expected[i] += gate * reference_mlp("swiglu", x_d, sp["wi_0"][j], sp["wi_1"][j],
                                          sp["wo"][j])
  np.testing.assert_allclose(np.asarray(y_btd).reshape(-1, 8), expected, rtol=2e-4,
                             atol=2e-5)


def test_jitter_noise_needs_an_rng_in_training_only():
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=32, router_init_std=2.0,
                  router=TokenChoiceRouter(jitter_noise=0.5))
  layer = MoeLayer(cfg, "swiglu", 12)
  x_btd = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 8))
  params = layer.init(jax.random.PRNGKey(1), x_btd, train=False)
  plain = MoeLayer(cfg.replace(router=TokenChoiceRouter()), "swiglu", 12)
  y_eval, _ = layer.apply(params, x_btd, train=False)
  np.testing.assert_array_equal(y_eval, plain.apply(params, x_btd, train=False)[0])
  with pytest.raises(Exception, match="jitter"):
    layer.apply(params, x_btd, train=True)
  noisy = [layer.apply(params, x_btd, train=True, rngs={"jitter": jax.random.PRNGKey(s)}
                       )[0] for s in (0, 0, 1)]
  np.testing.assert_array_equal(noisy[0], noisy[1])
  assert not np.allclose(noisy[0], noisy[2])
  assert not np.allclose(noisy[0], plain.apply(params, x_btd, train=True)[0])


def test_jitter_scales_the_router_input_by_uniform_noise_around_one():
  """flaxformer's (and ST-MoE's) jitter: the router sees x * U(1 - eps, 1 + eps),
  one draw per element. With x = 1 and the identity as router weights the logits
  are the draws themselves: 2048 of them span [0.5, 1.5] with mean 1 (x / u would
  reach 2 and average ln 3 = 1.10)."""
  eps = 0.5
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=512,
                  router=TokenChoiceRouter(jitter_noise=eps))
  layer = MoeLayer(cfg, "swiglu", 12)
  x_btd = jnp.ones((2, 256, 4))
  params = nn.unbox(layer.init(jax.random.PRNGKey(1), x_btd, train=False))
  params["params"]["router"]["w"] = jnp.eye(4)
  _, state = layer.apply(params, x_btd, train=True, rngs={"jitter": jax.random.PRNGKey(2)},
                         capture_intermediates=lambda mdl, _: mdl.name == "router",
                         mutable=["intermediates"])
  u = np.asarray(state["intermediates"]["router"]["__call__"][0]).ravel()
  assert u.size == 2048
  assert u.min() >= 1 - eps and u.max() <= 1 + eps
  assert u.min() < 1 - eps + 0.01 and u.max() > 1 + eps - 0.01
  assert abs(u.mean() - 1.0) < 0.03  # the mean's std: 0.5 / sqrt(3 x 2048) = 0.0064


def test_router_z_loss_covers_the_gated_shared_experts_logits():
  """ST-MoE's z-loss is over every router logit: with jointly gated shared experts
  that includes their columns, mean over tokens of logsumexp(x [w | w_shared])^2."""
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=32, num_shared_experts=2,
                  shared_expert_d_ff=6, shared_experts_gated=True, router_init_std=1.0)
  x_btd = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 8))
  layer = MoeLayer(cfg, "swiglu", 12)
  params = nn.unbox(jax.jit(lambda x: layer.init(jax.random.PRNGKey(0), x,
                                                 train=False))(x_btd))
  _, aux = jax.jit(lambda p, x: layer.apply(p, x, train=False))(params, x_btd)
  router = params["params"]["router"]
  logits_na = np.asarray(x_btd, np.float64).reshape(-1, 8) @ np.concatenate(
      [np.asarray(router["w"]), np.asarray(router["w_shared"])], axis=1)
  top_n = logits_na.max(-1)
  lse_n = top_n + np.log(np.exp(logits_na - top_n[:, None]).sum(-1))
  assert float(aux["z_loss"]) == pytest.approx(np.mean(lse_n ** 2), rel=1e-5)
