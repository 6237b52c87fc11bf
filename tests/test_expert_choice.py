"""Expert-choice router: loop reference, exact capacity, sequence isolation, stats."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.config import MoeConfig
from openmoe_jax.moe import gates as gates_lib
from openmoe_jax.moe import losses
from openmoe_jax.moe.dispatch.einsum import dispatch_mask
from openmoe_jax.moe.layer import router_arguments
from openmoe_jax.moe.routers_expert_choice import (ExpertChoiceRouter,
                                                   expert_choice_routing)
from openmoe_jax.objectives.common import moe_metrics

from moe_reference import reference_expert_choice


def _route(router, cfg, logits, sequence_length):
  scores = gates_lib.gate_scores(logits, cfg.num_experts, cfg.gate)
  fn = jax.jit(lambda x: router(x, **router_arguments(cfg, train=True),
                                sequence_length=sequence_length))
  return scores, *fn(scores)


@pytest.mark.parametrize("level", ["batch", "sequence"])
@pytest.mark.parametrize("gate,renormalize,factors,scaling", [
    ("softmax", False, None, 1.0),
    ("sigmoid", True, None, 2.0),
    ("softmax", True, (0.0, 1.0, 0.5, 0.25, 0.125), 1.5),
])
def test_expert_choice_matches_loop_reference(level, gate, renormalize, factors, scaling):
  g, s, t, num_experts, k = 2, 24, 8, 4, 1
  router = ExpertChoiceRouter(level=level, count_scaling_factors=factors)
  cfg = MoeConfig(num_experts=num_experts, top_k=k, capacity_factor_train=1.0,
                  gate=gate, renormalize_gates=renormalize, routed_scaling_factor=scaling,
                  router=router)
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.integers(-2, 3, size=(g, s, num_experts)), jnp.float32)
  router_scores, routing, aux = _route(router, cfg, logits, t)
  unit = t if level == "sequence" else s
  capacity = round(k * unit / num_experts)
  assert routing.capacity == capacity * (s // unit)
  no_expert = 0
  for gi in range(g):
    kept, gates = reference_expert_choice(
        np.asarray(router_scores.scores[gi], np.float64), capacity, unit, renormalize, factors,
        scaling)
    np.testing.assert_array_equal(routing.kept[gi], kept)
    np.testing.assert_allclose(routing.gates[gi], gates, rtol=1e-6, atol=1e-7)
    no_expert += np.sum(~kept.any(-1))
  np.testing.assert_array_equal(routing.expert_index[0, 5], np.arange(num_experts))
  assert no_expert > 0, "the case must leave some tokens unpicked"
  assert float(aux["no_expert_fraction"]) == pytest.approx(no_expert / (g * s))
  assert float(aux["drop_fraction"]) == pytest.approx(no_expert / (g * s))
  count = np.asarray(routing.kept).sum(-1)
  assert float(aux["experts_per_token_mean"]) == pytest.approx(count.mean())
  assert float(aux["experts_per_token_min"]) == count.min() == 0
  assert float(aux["experts_per_token_max"]) == count.max()


@pytest.mark.parametrize("level", ["batch", "sequence"])
def test_every_expert_takes_exactly_capacity_tokens(level):
  g, b, t, num_experts = 1, 4, 16, 8
  router = ExpertChoiceRouter(level=level)
  cfg = MoeConfig(num_experts=num_experts, top_k=2, capacity_factor_train=1.0,
                  router=router)
  logits = jax.random.normal(jax.random.PRNGKey(0), (g, b * t, num_experts)) * 3
  _, routing, _ = _route(router, cfg, logits, t)
  kept = np.asarray(routing.kept)
  slot = np.asarray(routing.slot)
  if level == "batch":
    np.testing.assert_array_equal(kept.sum(axis=1), np.full((g, num_experts), 16))
  else:
    per_seq = kept.reshape(g, b, t, num_experts).sum(axis=2)
    np.testing.assert_array_equal(per_seq, np.full((g, b, num_experts), 4))
    # Sequence j of a group fills slots [4j, 4j + 4) of every expert: no expert buffer
    # slot range ever holds tokens of two sequences.
    seq_of_token = np.repeat(np.arange(b), t)[None, :, None]
    np.testing.assert_array_equal((slot // 4)[kept],
                                  np.broadcast_to(seq_of_token, kept.shape)[kept])
  dispatch = np.asarray(dispatch_mask(routing, num_experts))
  assert np.all(dispatch.sum(axis=1) == 1)  # every expert slot holds one token


def test_sequence_level_never_looks_at_other_sequences():
  router = ExpertChoiceRouter(level="sequence")
  cfg = MoeConfig(num_experts=4, top_k=1, capacity_factor_train=1.0, router=router)
  logits = jax.random.normal(jax.random.PRNGKey(1), (1, 16, 4))
  _, routing, _ = _route(router, cfg, logits, 8)
  changed = logits.at[:, 8:].multiply(-5.0)  # rewrite the second sequence only
  _, routing2, _ = _route(router, cfg, changed, 8)
  np.testing.assert_array_equal(routing.kept[:, :8], routing2.kept[:, :8])
  np.testing.assert_array_equal(routing.slot[:, :8], routing2.slot[:, :8])
  with pytest.raises(ValueError, match="whole sequences"):
    _route(router, cfg, logits[:, :12], 8)


def test_ties_go_to_the_earlier_token_and_capacity_formula():
  scores = jnp.asarray([[[0.5, 0.1], [0.5, 0.3], [0.5, 0.3], [0.2, 0.3]]])
  routing = expert_choice_routing(scores, capacity=2)
  np.testing.assert_array_equal(routing.kept[0], [[1, 0], [1, 1], [0, 1], [0, 0]])
  np.testing.assert_array_equal(routing.slot[0, 1:3], [[1, 0], [0, 1]])
  cfg = MoeConfig(num_experts=64, top_k=2, capacity_factor_train=1.0,
                  capacity_factor_eval=2.0)
  router = ExpertChoiceRouter()
  capacity = lambda cfg, t, train: router.capacity(
      t, num_experts=cfg.num_experts, top_k=cfg.top_k,
      capacity_factor=cfg.capacity_factor(train))
  assert capacity(cfg, 2048, True) == 64
  assert capacity(cfg, 2048, False) == 128
  assert capacity(cfg, 8, True) == 1  # at least 1
  assert capacity(cfg.replace(num_experts=2, capacity_factor_train=4.0), 8,
                  True) == 8  # at most every token
  with pytest.raises(ValueError, match="level"):
    ExpertChoiceRouter(level="token")


def test_count_scaling_factors_hand_computed():
  # 3 tokens, 2 experts, capacity 2: e0 takes t0, t1; e1 takes t1, t2.
  scores = jnp.asarray([[[0.9, 0.1], [0.8, 0.7], [0.1, 0.6]]])
  routing = expert_choice_routing(scores, 2, renormalize=True,
                                  count_factors=(0.0, 1.0, 3.0))
  np.testing.assert_allclose(routing.gates[0],
                             [[1.0, 0.0], [3 * 0.8 / 1.5, 3 * 0.7 / 1.5], [0.0, 1.0]],
                             rtol=1e-6)
  for factors in ((1.0, 1.0), (1.0, 1.0, 1.0, 1.0)):  # one too few, one too many
    with pytest.raises(ValueError, match=f"needs num_experts \\+ 1 = 3 entries, got "
                       f"{len(factors)}"):
      expert_choice_routing(scores, 2, count_factors=factors)


def test_tokenwise_lb_loss_is_one_uniform_and_larger_when_skewed():
  u, t, num_experts, k = 2, 16, 4, 2
  uniform = jnp.zeros((u, t, num_experts))
  balanced = (np.arange(t)[:, None] + np.arange(k)[None] * 3) % num_experts
  kept = np.zeros((u, t, num_experts), bool)
  for j in range(k):
    kept[:, np.arange(t), balanced[:, j]] = True
  loss = losses.tokenwise_load_balancing_loss(uniform, jnp.asarray(kept), k)
  assert float(loss) == pytest.approx(1.0, rel=1e-6)
  # Through the router: uniform logits, every token gets exactly k experts.
  router = ExpertChoiceRouter()
  cfg = MoeConfig(num_experts=num_experts, top_k=k, capacity_factor_train=1.0,
                  router=router)
  _, _, aux = _route(router, cfg, uniform.reshape(1, u * t, num_experts), t)
  assert float(aux["tokenwise_lb_loss"]) == pytest.approx(1.0, rel=1e-6)
  # Skewed: the first tokens score high for every expert and collect all of them.
  skew = jnp.broadcast_to(jnp.linspace(3.0, -3.0, t)[None, :, None], (1, t, num_experts))
  _, _, aux = _route(router, cfg, skew, t)
  assert float(aux["tokenwise_lb_loss"]) > 1.5
  assert float(aux["no_expert_fraction"]) == pytest.approx(0.5)


def test_moe_metrics_reduce_each_statistic_over_layers_as_named():
  """Two MoE layers: means over layers for the means, the smallest per-token expert
  count for `_min`, the largest for `_max`; per-layer metrics under the model layer
  numbers given."""
  aux = {"aux_loss": jnp.float32(0.5), "lb_loss": jnp.float32(0.25),
         "z_loss": jnp.float32(0.125),
         "drop_fraction": jnp.asarray([0.1, 0.3]),
         "drop_fraction_first_quarter": jnp.asarray([0.0, 0.2]),
         "drop_fraction_last_quarter": jnp.asarray([0.4, 0.6]),
         "router_entropy": jnp.asarray([1.0, 2.0]),
         "expert_load": jnp.asarray([[0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0]]),
         "tokenwise_lb_loss": jnp.float32(0.0625),
         "no_expert_fraction": jnp.asarray([0.0, 0.5]),
         "experts_per_token_mean": jnp.asarray([2.0, 1.0]),
         "experts_per_token_min": jnp.asarray([1.0, 0.0]),
         "experts_per_token_max": jnp.asarray([3.0, 4.0])}
  m = {k: float(v) for k, v in moe_metrics(aux, [1, 3]).items()}
  assert m["moe/drop_fraction"] == pytest.approx(0.2)
  assert m["moe/drop_fraction_last_quarter"] == pytest.approx(0.5)
  assert m["moe/router_entropy"] == pytest.approx(1.5)
  assert m["moe/expert_load_cv"] == pytest.approx((0.0 + 1.0) / 2)  # std/mean: 0, 1
  assert m["moe/no_expert_fraction"] == pytest.approx(0.25)
  assert m["moe/experts_per_token_mean"] == pytest.approx(1.5)
  assert m["moe/experts_per_token_min"] == 0.0
  assert m["moe/experts_per_token_max"] == 4.0
  assert m["moe/layer_3/drop_fraction"] == pytest.approx(0.3)
  assert m["moe/layer_1/expert_load_cv"] == pytest.approx(0.0)
  assert m["moe/tokenwise_lb_loss"] == 0.0625
  per_layer = {f"moe/layer_{n}/{name}" for n in (1, 3) for name in (
      "drop_fraction", "drop_fraction_first_quarter", "drop_fraction_last_quarter",
      "expert_load_cv")}
  token_choice = {"moe/aux_loss", "moe/lb_loss", "moe/z_loss", "moe/drop_fraction",
                  "moe/drop_fraction_first_quarter", "moe/drop_fraction_last_quarter",
                  "moe/router_entropy", "moe/expert_load_cv"} | per_layer
  expert_choice = {"moe/tokenwise_lb_loss", "moe/no_expert_fraction",
                   "moe/experts_per_token_mean", "moe/experts_per_token_min",
                   "moe/experts_per_token_max"}
  assert set(m) == token_choice | expert_choice
  # A token-choice router reports none of expert choice's statistics.
  plain = {k: v for k, v in aux.items()
           if k not in ("tokenwise_lb_loss", "no_expert_fraction")
           and not k.startswith("experts_per_token")}
  assert set(moe_metrics(plain, [1, 3])) == token_choice
  # Without model layer numbers, the MoE layers are counted from 0.
  assert {k for k in moe_metrics(plain) if k.startswith("moe/layer_")} == {
      k.replace("layer_1/", "layer_0/").replace("layer_3/", "layer_1/") for k in per_layer}
  with pytest.raises(ValueError, match="1 layer numbers for 2 MoE layers"):
    moe_metrics(plain, [3])
