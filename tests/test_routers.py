"""Token-choice routing: hand-computed cases (ST-MoE / flaxformer priority and the
causal position-major priority), gate functions, and the router class against the
NumPy loop oracle (tests/moe_reference.py)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.config import MoeConfig
from openmoe_jax.moe import gates as gates_lib
from openmoe_jax.moe import losses
from openmoe_jax.moe.dispatch.einsum import combine_weights, dispatch_mask
from openmoe_jax.moe.layer import MoeLayer, router_arguments
from openmoe_jax.moe.routers import (Routing, expert_capacity, routing_stats, token_stats,
                                     top_k_capacity_routing)
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter

from moe_reference import (reference_gates, reference_token_capacity,
                           reference_token_choice)

# 4 tokens, 3 experts. Choices (1st, 2nd): t0 (e0, e1), t1 (e0, e1), t2 (e1, e0),
# t3 (e0, e2).
PROBS = np.array([[[0.6, 0.3, 0.1],
                   [0.5, 0.4, 0.1],
                   [0.2, 0.7, 0.1],
                   [0.7, 0.1, 0.2]]], np.float32)


@pytest.mark.parametrize("tokens,experts,factor,minimum,expected", [
    (4096, 16, 1.25, 4, 320),   # OpenMoE-Base training
    (4096, 16, 2.0, 4, 512),    # OpenMoE-Base evaluation
    (64, 16, 1.25, 4, 5),       # round(5.0)
    (16, 16, 1.25, 4, 4),       # round(1.25) = 1 < min_capacity
    (100, 8, 1.0, 0, 12),       # round(12.5) = 12 (banker's rounding, like int(round()))
])
def test_capacity_formula(tokens, experts, factor, minimum, expected):
  assert expert_capacity(tokens, experts, factor, minimum) == expected


def test_capacity_per_choice_multiplies_by_top_k():
  cfg = MoeConfig(num_experts=16, top_k=4, capacity_factor_train=1.25,
                  capacity_factor_eval=2.0, min_capacity=4)
  st_moe, megatron = TokenChoiceRouter(), TokenChoiceRouter(capacity_per_choice=True)
  args = lambda train: dict(num_experts=cfg.num_experts, top_k=cfg.top_k,
                            capacity_factor=cfg.capacity_factor(train),
                            min_capacity=cfg.min_capacity)
  assert st_moe.capacity(256, **args(True)) == 20  # 1.25 x 256 / 16
  assert megatron.capacity(256, **args(True)) == 80  # 1.25 x 4 x 256 / 16
  assert megatron.capacity(256, **args(False)) == 128
  assert TokenChoiceRouter(dropless=True, capacity_per_choice=True).capacity(
      256, **args(True)) == 256


def test_first_choices_before_second_then_sequence_order():
  routing = top_k_capacity_routing(jnp.asarray(PROBS), top_k=2, capacity=2)
  np.testing.assert_array_equal(routing.expert_index[0], [[0, 1], [0, 1], [1, 0], [0, 2]])
  # Rank 1 in sequence order: t0->e0#0, t1->e0#1, t2->e1#0, t3->e0#2 (full).
  # Rank 2: t0->e1#1 (after t2's 1st choice), t1->e1#2 (full), t2->e0#3 (full),
  # t3->e2#0.
  np.testing.assert_array_equal(routing.slot[0], [[0, 1], [1, 2], [0, 3], [2, 0]])
  np.testing.assert_array_equal(routing.kept[0],
                                [[True, True], [True, False], [True, False], [False, True]])


def test_position_major_serves_each_token_before_the_next():
  routing = top_k_capacity_routing(jnp.asarray(PROBS), top_k=2, capacity=2,
                                   priority="position_major")
  # t0: e0#0, e1#0; t1: e0#1, e1#1; t2: e1 full, e0 full; t3: e0 full, e2#0.
  np.testing.assert_array_equal(routing.slot[0], [[0, 0], [1, 1], [2, 2], [3, 0]])
  np.testing.assert_array_equal(routing.kept[0],
                                [[True, True], [True, True], [False, False], [False, True]])
  np.testing.assert_allclose(routing.gates[0],
                             [[0.6, 0.3], [0.5, 0.4], [0.0, 0.0], [0.0, 0.2]], rtol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("capacity", [1, 2, 5])
def test_position_major_routing_ignores_later_tokens(top_k, capacity):
  """Causality at the router: replacing the scores of positions >= t leaves the
  routing of positions < t unchanged, for every t. Choice-major routing breaks this
  for top_k >= 2 (asserted on the same data)."""
  s, num_experts = 16, 4
  base_se = jax.nn.softmax(_tied_logits(10 + top_k, 1, s, num_experts)[0], axis=-1)
  other_se = jax.nn.softmax(_tied_logits(20 + top_k, 1, s, num_experts)[0], axis=-1)
  later_ts1 = (jnp.arange(s)[None, :] >= jnp.arange(s)[:, None])[..., None]
  # Group t: the base scores with positions >= t replaced; group 0 is all `other`.
  probs_gse = jnp.where(later_ts1, other_se[None], base_se[None])
  earlier_ts = ~later_ts1[..., 0]
  leaks = {}
  for priority in ("position_major", "choice_major"):
    route = jax.jit(lambda p: top_k_capacity_routing(p, top_k, capacity,
                                                     priority=priority))
    base, changed = route(base_se[None]), route(probs_gse)
    same_ts = ((changed.kept == base.kept) & (changed.slot == base.slot)).all(-1)
    leaks[priority] = int(np.sum(earlier_ts & ~np.asarray(same_ts)))
    assert np.mean(~np.asarray(base.kept)) > 0, "the case must overflow experts"
  assert leaks["position_major"] == 0
  if top_k == 1:
    assert leaks["choice_major"] == 0  # one choice per token: the orders coincide
  else:
    assert leaks["choice_major"] > 0, "choice-major routing should see later tokens"


def test_priority_is_validated_and_refuses_batch_prioritized():
  with pytest.raises(ValueError, match="priority"):
    TokenChoiceRouter(priority="token_major")
  with pytest.raises(ValueError, match="batch_prioritized"):
    TokenChoiceRouter(batch_prioritized=True, priority="position_major")
  with pytest.raises(ValueError, match="priority"):
    top_k_capacity_routing(jnp.asarray(PROBS), 2, 2, priority="rank_major")
  with pytest.raises(ValueError, match="batch_prioritized"):
    top_k_capacity_routing(jnp.asarray(PROBS), 2, 2, batch_prioritized=True,
                           priority="position_major")
  assert TokenChoiceRouter().priority == "choice_major"  # flaxformer / OpenMoE


def test_dropless_serves_every_choice_under_either_priority():
  # Every token's 1st choice is e0: a full buffer of 16 in each group.
  probs = jax.nn.softmax(_tied_logits(7, 2, 16, 4).at[..., 0].add(9.0), axis=-1)
  choice = top_k_capacity_routing(probs, 3, capacity=16)
  position = top_k_capacity_routing(probs, 3, capacity=16, priority="position_major")
  assert np.all(choice.kept) and np.all(position.kept)
  np.testing.assert_array_equal(choice.gates, position.gates)
  for routing in (choice, position):  # distinct slots per expert
    assert np.asarray(dispatch_mask(routing, 4)).sum(axis=1).max() == 1


def test_combine_weights_are_router_probs_of_kept_choices():
  routing = top_k_capacity_routing(jnp.asarray(PROBS), top_k=2, capacity=2)
  np.testing.assert_allclose(routing.gates[0],
                             [[0.6, 0.3], [0.5, 0.0], [0.7, 0.0], [0.0, 0.2]], rtol=1e-6)
  combine = np.asarray(combine_weights(routing, 3))[0]
  dispatch = np.asarray(dispatch_mask(routing, 3))[0]
  assert combine.shape == (4, 3, 2)
  assert combine[0, 0, 0] == pytest.approx(0.6) and combine[0, 1, 1] == pytest.approx(0.3)
  assert combine[3, 2, 0] == pytest.approx(0.2)
  assert dispatch.sum() == 5  # kept choices only
  assert np.all(dispatch.sum(axis=0) <= 1)  # one token per expert slot
  np.testing.assert_allclose(combine, dispatch * combine)


def test_renormalised_gates_sum_to_one_before_dropping():
  routing = top_k_capacity_routing(jnp.asarray(PROBS), top_k=2, capacity=8,
                                   renormalize=True)
  np.testing.assert_allclose(routing.gates[0].sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(routing.gates[0, 0], [0.6 / 0.9, 0.3 / 0.9], rtol=1e-6)


def test_routing_stats_drop_fraction_and_load():
  routing = top_k_capacity_routing(jnp.asarray(PROBS), top_k=2, capacity=2)
  stats = routing_stats(routing, jnp.asarray(PROBS))
  assert float(stats["drop_fraction"]) == pytest.approx(3 / 8)
  np.testing.assert_allclose(stats["expert_load"], [4 / 8, 3 / 8, 1 / 8])
  entropy = -np.sum(PROBS * np.log(PROBS), -1).mean()
  assert float(stats["router_entropy"]) == pytest.approx(entropy, rel=1e-5)


@pytest.mark.parametrize("length,first,last", [
    (4, 3 / 4, 1 / 4),  # quarter = 1 position: rows 0, 4 and rows 3, 7
    (2, 1 / 2, 1 / 8),  # 2 // 4 = 0, still 1 position: even rows and odd rows
])
def test_token_stats_quarters_of_short_sequences(length, first, last):
  # One group of 8 tokens, 2 choices each; the group holds 8 / length sequences.
  dropped_gsj = np.array([[[1, 0], [0, 0], [0, 0], [0, 1],
                           [1, 1], [0, 0], [1, 0], [0, 0]]], bool)
  routing = Routing(expert_index=jnp.zeros((1, 8, 2), jnp.int32),
                    slot=jnp.zeros((1, 8, 2), jnp.int32),
                    kept=jnp.asarray(~dropped_gsj),
                    gates=jnp.zeros((1, 8, 2)), capacity=8)
  stats = token_stats(routing, jnp.full((1, 8, 2), 0.5), jnp.asarray(dropped_gsj),
                      length)
  assert float(stats["drop_fraction"]) == pytest.approx(5 / 16)
  assert float(stats["drop_fraction_first_quarter"]) == pytest.approx(first)
  assert float(stats["drop_fraction_last_quarter"]) == pytest.approx(last)
  assert float(stats["no_expert_fraction"]) == pytest.approx(1 / 8)  # token 4
  assert float(stats["experts_per_token_mean"]) == pytest.approx(11 / 8)
  assert float(stats["experts_per_token_min"]) == 0
  assert float(stats["experts_per_token_max"]) == 2


def test_groups_route_independently():
  probs = jnp.concatenate([jnp.asarray(PROBS)] * 3)
  routing = top_k_capacity_routing(probs, top_k=2, capacity=2)
  for g in range(3):
    np.testing.assert_array_equal(routing.slot[g], [[0, 1], [1, 2], [0, 3], [2, 0]])


def test_load_balancing_loss_hand_computed():
  # Both tokens choose e0 (top-1): f = [1, 0]; p = [0.7, 0.3]; E^2 * mean = 4 * 0.35.
  probs = jnp.asarray([[[0.8, 0.2], [0.6, 0.4]]])
  index = jnp.asarray([[[0], [0]]])
  assert float(losses.load_balancing_loss(probs, index)) == pytest.approx(1.4)


def test_load_balancing_loss_minimal_under_uniform_routing():
  num_experts, k, s = 8, 2, 64
  uniform = jnp.full((1, s, num_experts), 1.0 / num_experts)
  balanced = (jnp.arange(s * k).reshape(1, s, k)) % num_experts
  uniform_loss = float(losses.load_balancing_loss(uniform, balanced))
  assert uniform_loss == pytest.approx(k)
  rng = np.random.default_rng(0)
  for _ in range(20):
    logits = rng.normal(size=(1, s, num_experts)) * 3
    probs = jax.nn.softmax(jnp.asarray(logits), -1)
    _, index = jax.lax.top_k(probs, k)
    assert float(losses.load_balancing_loss(probs, index)) >= uniform_loss - 1e-6


def test_router_z_loss_hand_computed():
  logits = jnp.asarray([[[0.0, 0.0], [1.0, 2.0]]])
  lse = [math.log(2.0), math.log(math.e + math.e ** 2)]
  expected = (lse[0] ** 2 + lse[1] ** 2) / 2
  assert float(losses.router_z_loss(logits)) == pytest.approx(expected, rel=1e-6)


# --- Router classes against the NumPy loop oracle (tests/moe_reference.py) ----------


def _tied_logits(seed, g, s, num_experts):
  """Integer-valued logits in a narrow range: many exact ties between experts."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(-2, 3, size=(g, s, num_experts)), jnp.float32)


ROUTER_CASES = {  # id: (router, gate, renormalize, scaling)
    "st_moe": (TokenChoiceRouter(), "softmax", False, 1.0),
    "st_moe_sigmoid": (TokenChoiceRouter(), "sigmoid", True, 2.5),
    "dropless": (TokenChoiceRouter(dropless=True), "softmax", True, 1.0),
    "dropless_sigmoid": (TokenChoiceRouter(dropless=True), "sigmoid", False, 1.0),
    "bpr": (TokenChoiceRouter(batch_prioritized=True), "softmax", True, 1.0),
    "bpr_sigmoid": (TokenChoiceRouter(batch_prioritized=True), "sigmoid", False, 0.5),
    "position_major": (TokenChoiceRouter(priority="position_major"), "softmax", False,
                       1.0),
    "position_major_sigmoid": (TokenChoiceRouter(priority="position_major"), "sigmoid",
                               True, 2.5),
    "per_choice": (TokenChoiceRouter(capacity_per_choice=True), "softmax", True, 1.0),
    "per_choice_position_major": (
        TokenChoiceRouter(capacity_per_choice=True, priority="position_major"),
        "sigmoid", False, 1.0),
}


@pytest.mark.parametrize("router,gate,renormalize,scaling",
                         list(ROUTER_CASES.values()), ids=list(ROUTER_CASES))
@pytest.mark.parametrize("top_k", [1, 3])
def test_token_choice_router_matches_loop_reference(router, gate, renormalize, scaling,
                                                    top_k):
  g, s, num_experts = 2, 24, 4
  cfg = MoeConfig(num_experts=num_experts, top_k=top_k, capacity_factor_train=0.75,
                  min_capacity=1, gate=gate, renormalize_gates=renormalize,
                  routed_scaling_factor=scaling, router=router)
  logits = _tied_logits(top_k, g, s, num_experts)
  router_scores = gates_lib.gate_scores(logits, num_experts, gate)
  routing, aux = jax.jit(lambda x: router(x, **router_arguments(cfg, train=True),
                                          sequence_length=12))(router_scores)
  capacity = reference_token_capacity(cfg, s, train=True)
  assert routing.capacity == capacity
  dropped = 0
  for gi in range(g):
    scores, _ = reference_gates(logits[gi], num_experts, gate)
    np.testing.assert_allclose(scores, router_scores.scores[gi], rtol=1e-6)
    expert, kept, gates = reference_token_choice(
        np.asarray(router_scores.scores[gi], np.float64), top_k, capacity, renormalize,
        router.batch_prioritized, scaling, router.priority)
    np.testing.assert_array_equal(routing.expert_index[gi], expert)
    np.testing.assert_array_equal(routing.kept[gi], kept)
    np.testing.assert_allclose(routing.gates[gi], gates, rtol=1e-6, atol=1e-7)
    dropped += (~kept).sum()
  if router.dropless:
    assert dropped == 0
  else:
    assert dropped > 0, "the case must overflow experts"
  assert float(aux["drop_fraction"]) == pytest.approx(dropped / (g * s * top_k))
  # Kept choices occupy distinct slots below capacity.
  dispatch = np.asarray(dispatch_mask(routing, num_experts))
  assert dispatch.sum() == routing.kept.sum() and dispatch.max() == 1
  assert np.all(dispatch.sum(axis=1) <= 1)


def test_batch_prioritized_serves_confident_tokens_first():
  # 4 tokens all want e0 (capacity 2): sequence order keeps t0, t1; BPR keeps the two
  # with the highest top-1 score (t3, t2).
  probs = jnp.asarray([[[0.5, 0.5 - 1e-3], [0.6, 0.4], [0.8, 0.2], [0.9, 0.1]]])
  plain = top_k_capacity_routing(probs, 1, 2)
  bpr = top_k_capacity_routing(probs, 1, 2, batch_prioritized=True)
  np.testing.assert_array_equal(plain.kept[0, :, 0], [True, True, False, False])
  np.testing.assert_array_equal(bpr.kept[0, :, 0], [False, False, True, True])
  np.testing.assert_array_equal(bpr.slot[0, 2:, 0], [1, 0])


def test_gate_functions_renormalisation_and_scaling_hand_computed():
  logits = jnp.asarray([[[0.0, math.log(3.0), 0.0, -1.0]]])
  soft = gates_lib.gate_scores(logits, 4, "softmax")
  denominator = 1 + 3 + 1 + math.exp(-1)
  np.testing.assert_allclose(soft.scores[0, 0], np.array([1, 3, 1, math.exp(-1)])
                             / denominator, rtol=1e-6)
  sig = gates_lib.gate_scores(logits, 4, "sigmoid")
  np.testing.assert_allclose(sig.scores[0, 0], [0.5, 0.75, 0.5, 1 / (1 + math.e)],
                             rtol=1e-6)
  np.testing.assert_allclose(sig.probs[0, 0].sum(), 1.0, rtol=1e-6)
  # Top-2 sigmoid gates (e1: 0.75, e0: 0.5 -- tie with e2 goes to the lower index),
  # renormalised to 0.6 / 0.4, then scaled by 2.5 -> 1.5 / 1.0.
  cfg = MoeConfig(num_experts=4, top_k=2, min_capacity=4, gate="sigmoid",
                  renormalize_gates=True, routed_scaling_factor=2.5)
  routing, _ = TokenChoiceRouter()(sig, **router_arguments(cfg, train=True),
                                    sequence_length=1)
  np.testing.assert_array_equal(routing.expert_index[0, 0], [1, 0])
  np.testing.assert_allclose(routing.gates[0, 0], [1.5, 1.0], rtol=1e-6)
  np.testing.assert_allclose(gates_lib.renormalise(
      jnp.asarray([0.2, 0.3, 0.5]), jnp.asarray([True, True, False])), [0.4, 0.6, 0.0])
  # Jointly gated shared experts: their logits are extra rows of one softmax.
  joint = gates_lib.gate_scores(jnp.concatenate([logits, jnp.zeros((1, 1, 1))], -1), 4,
                                "softmax")
  np.testing.assert_allclose(joint.shared[0, 0], [1 / (denominator + 1)], rtol=1e-6)
  np.testing.assert_allclose(joint.probs[0, 0], soft.scores[0, 0], rtol=1e-6)
  with pytest.raises(ValueError, match="MoeConfig.gate"):  # when the layer is built
    MoeLayer(MoeConfig(gate="relu"), "swiglu", 8).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 4, 8)), train=False)


@pytest.mark.parametrize("priority", ["choice_major", "position_major"])
def test_large_groups_count_slots_by_sort_like_a_loop(priority):
  """Above SLOTS_ONE_HOT_MAX (s k E entries per group) slots come from a sort; they
  are the counts a plain loop over the served order gives."""
  from openmoe_jax.moe import routers
  g, s, k, num_experts = 2, 2048, 2, 300  # 1.2M one-hot entries per group
  assert s * k * num_experts > routers.SLOTS_ONE_HOT_MAX
  probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(3), (g, s, num_experts)))
  routing = top_k_capacity_routing(probs, k, capacity=20, priority=priority)
  expert_gsk = np.asarray(routing.expert_index)
  want = np.zeros(expert_gsk.shape, int)
  for group in range(g):
    seen = np.zeros(num_experts, int)
    served = ([(t, j) for j in range(k) for t in range(s)] if priority == "choice_major"
              else [(t, j) for t in range(s) for j in range(k)])
    for t, j in served:
      want[group, t, j] = seen[expert_gsk[group, t, j]]
      seen[expert_gsk[group, t, j]] += 1
  np.testing.assert_array_equal(routing.slot, want)
  np.testing.assert_array_equal(routing.kept, want < 20)
