"""Decoder: masks, causality (routing included), packing, layer layout, scan and remat
equivalence, router losses against NumPy."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.layers.attention import Attention, make_attention_mask
from openmoe_jax.layers.norms import RMSNorm
from openmoe_jax.model import Decoder, layer_segments, scan_unit_length
from openmoe_jax.moe.routers import RouterLogits
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter
from openmoe_jax.objectives import CausalLm

from moe_reference import reference_expert_choice
from openmoe_numpy_forward import rms_norm as numpy_rms_norm

TINY = ModelConfig(vocab_size=64, d_model=16, num_heads=2, head_dim=8, d_ff=24,
                   num_layers=4, sparse_interval=2,
                   moe=MoeConfig(num_experts=4, group_size=4096, min_capacity=64))


def _init(cfg, tokens_bt):
  return nn.unbox(jax.jit(Decoder(cfg).init)(jax.random.PRNGKey(0), tokens_bt))


def _apply(cfg, **static):
  """Returns a jitted (params, tokens, **arrays) -> (logits, aux) for `cfg`."""
  return jax.jit(lambda p, toks, **arrays: Decoder(cfg).apply(p, toks, **arrays, **static))


def test_sparse_layer_layout_openmoe_base_and_dense_first():
  base = ModelConfig(num_layers=12, sparse_interval=4)
  assert [i for i, s in enumerate(base.sparse_layers()) if s] == [3, 7, 11]
  dense_first = ModelConfig(num_layers=12, sparse_interval=4, num_dense_first=4)
  assert [i for i, s in enumerate(dense_first.sparse_layers()) if s] == [7, 11]
  unit = (False, False, False, True)
  assert layer_segments(base.sparse_layers(), 4) == [(unit, 3)]
  assert layer_segments(dense_first.sparse_layers(), 4) == [((False,) * 4, 1), (unit, 2)]
  assert layer_segments((False,) * 3, 1) == [((False,), 3)]


def test_sparse_layer_layout_first_sparse_layer_is_num_dense_first():
  """The boundary i == num_dense_first: sparse when the interval puts a sparse layer
  there (every layer with interval 1, DeepSeek's first_k_dense_replace)."""
  every = ModelConfig(num_layers=5, sparse_interval=1, num_dense_first=2)
  assert [i for i, s in enumerate(every.sparse_layers()) if s] == [2, 3, 4]
  odd = ModelConfig(num_layers=8, sparse_interval=2, num_dense_first=3)
  assert [i for i, s in enumerate(odd.sparse_layers()) if s] == [3, 5, 7]
  assert ModelConfig(num_layers=3, sparse_interval=1).sparse_layers() == (True,) * 3


def test_attention_masks_by_kind():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 0]])
  prefix = jnp.asarray([[1, 1, 0, 1, 0, 0]])
  causal = np.asarray(make_attention_mask("causal", 6, seg, batch=1))[0, 0]
  bidi = np.asarray(make_attention_mask("bidirectional", 6, seg, batch=1))[0, 0]
  pre = np.asarray(make_attention_mask("prefix", 6, seg, prefix, batch=1))[0, 0]
  same = np.asarray(seg[0][:, None] == seg[0][None, :])
  np.testing.assert_array_equal(bidi, same)
  np.testing.assert_array_equal(causal, same & np.tri(6, dtype=bool))
  assert pre[0, 1] and not causal[0, 1]  # inside the prefix: bidirectional
  assert not pre[0, 2] and pre[2, 0]  # targets stay causal
  assert not pre[0, 3] and not pre[3, 1]  # never across segments
  with pytest.raises(ValueError, match="prefix"):
    make_attention_mask("prefix", 6, seg, None)
  with pytest.raises(ValueError, match="unknown attention kind"):
    make_attention_mask("sideways", 6)


def _future_leak(cfg, tokens_t, num_values=3, seed=0):
  """Returns (largest |change| of any logit at a position before a changed token,
  largest |change| at or after it, mean MoE drop fraction of the unchanged rows).

  Each row of the batch changes one position p >= 1 of `tokens_t` to another id;
  it is compared with an unchanged row at the same batch index (same program, so
  equal inputs give bitwise equal outputs).
  """
  t = tokens_t.shape[0]
  rng = np.random.default_rng(seed)
  rows, changed_at = [], []
  for p in range(1, t):
    for shift in rng.choice(np.arange(1, cfg.vocab_size), num_values, replace=False):
      rows.append(tokens_t.at[p].set((tokens_t[p] + shift) % cfg.vocab_size))
      changed_at.append(p)
  changed_bt = jnp.stack(rows)
  base_bt = jnp.broadcast_to(tokens_t, changed_bt.shape)
  params = _init(cfg, base_bt)
  apply = _apply(cfg, train=True)
  base_btv, aux = apply(params, base_bt)
  changed_btv, _ = apply(params, changed_bt)
  diff_bt = np.abs(np.asarray(changed_btv) - np.asarray(base_btv)).max(-1)
  before_bt = np.arange(t)[None, :] < np.asarray(changed_at)[:, None]
  return (float(diff_bt[before_bt].max()), float(diff_bt[~before_bt].max()),
          float(np.mean(aux["drop_fraction"])))


def _routed(top_k, capacity, priority, t=8):
  """Returns a 2-layer, all-MoE TINY variant: one routing group per row of t tokens,
  `capacity` slots per expert, `priority` token-choice order."""
  return TINY.replace(num_layers=2, sparse_interval=1, moe=TINY.moe.replace(
      top_k=top_k, group_size=t, capacity_factor_train=0.01, min_capacity=capacity,
      router=TokenChoiceRouter(priority=priority)))


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_changing_a_later_token_never_changes_earlier_logits_position_major(
    top_k, capacity):
  """Causality of the whole decoder, routing decisions included.

  A Jacobian cannot see routing: drops are discrete decisions, piecewise constant in
  the inputs, so d logits / d later embeddings is zero even where a later token
  changes which earlier choices are served. So this test changes later tokens and
  compares earlier logits exactly. It holds for the "position_major" priority at
  every k and capacity; the default "choice_major" (flaxformer's order) is not
  causal for k >= 2 with a finite capacity (next test). Expert choice is not causal
  either (an expert picks among all tokens of its unit); it is not tested here.
  Limits: one base sequence and 3 replacement ids per position, groups of one row
  (a group spanning rows makes a row's routing depend on the earlier rows of its
  group too, never on later positions of its own row). The order itself is checked
  for all prefixes in test_routers.py and against the oracle.
  """
  tokens_t = jax.random.randint(jax.random.PRNGKey(1), (8,), 0, TINY.vocab_size)
  before, after, drops = _future_leak(_routed(top_k, capacity, "position_major"),
                                      tokens_t)
  assert before == 0.0
  assert after > 0  # the changed tokens do change the logits from their position on
  assert drops > 0, "experts must overflow for the test to mean anything"


def test_choice_major_lets_a_later_token_change_earlier_logits():
  """flaxformer's order serves every 1st choice before any 2nd choice: a later
  token's 1st choice can take the slot an earlier token's 2nd choice needed."""
  tokens_t = jax.random.randint(jax.random.PRNGKey(1), (8,), 0, TINY.vocab_size)
  leak, _, _ = _future_leak(_routed(2, 1, "choice_major"), tokens_t)
  assert leak > 1e-3
  top1_leak, _, _ = _future_leak(_routed(1, 1, "choice_major"), tokens_t)
  assert top1_leak == 0.0  # one choice per token: the two orders coincide


def test_changing_a_future_token_leaves_past_logits_unchanged():
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, TINY.vocab_size)
  params = _init(TINY, tokens)
  apply = _apply(TINY, train=False)
  logits = apply(params, tokens)[0]
  changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % TINY.vocab_size)
  logits2 = apply(params, changed)[0]
  # Not bit for bit: on an AVX2-only AMD EPYC (Zen 3) the einsum dispatcher's past
  # logits moved by up to 6.6e-7 (XLA:CPU's kernels; the sort dispatcher's did not
  # move). A leak through attention or routing moves them by 1e-3 or more (see the
  # choice-major test above); the tolerance sits far below that.
  np.testing.assert_allclose(logits[:, :7], logits2[:, :7], rtol=0, atol=1e-5)
  assert not np.allclose(logits[:, 7:], logits2[:, 7:])


@pytest.mark.parametrize("kind", ["causal", "bidirectional"])
def test_packed_segments_do_not_see_each_other(kind):
  seg = jnp.asarray([[1] * 5 + [2] * 7])
  pos = jnp.asarray([list(range(5)) + list(range(7))])
  tokens = jax.random.randint(jax.random.PRNGKey(3), (1, 12), 0, TINY.vocab_size)
  params = _init(TINY, tokens)
  apply = _apply(TINY, attention_kind=kind)
  run = lambda toks: apply(params, toks, positions_bt=pos, segment_ids_bt=seg)[0]
  other = tokens.at[:, :5].set((tokens[:, :5] + 3) % TINY.vocab_size)
  np.testing.assert_allclose(run(tokens)[:, 5:], run(other)[:, 5:], atol=1e-6)
  # Segment 2 packed equals segment 2 run on its own (positions restart at 0).
  alone = apply(params, tokens[:, 5:])[0]
  np.testing.assert_allclose(run(tokens)[:, 5:], alone, rtol=1e-5, atol=1e-5)


def test_scanned_and_unrolled_layers_compute_the_same():
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 8), 0, TINY.vocab_size)
  params = _init(TINY, tokens)
  unrolled_cfg = TINY.replace(scan_layers=False)
  unrolled = {k: v for k, v in params["params"].items() if not k.startswith("layers_")}
  for r in range(2):
    unrolled[f"layers_0_{r}"] = jax.tree.map(lambda a: a[r], params["params"]["layers_0"])
  expected, aux = _apply(TINY, train=True)(params, tokens)
  got, aux2 = _apply(unrolled_cfg, train=True)({"params": unrolled}, tokens)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(aux2["expert_load"], aux["expert_load"], atol=1e-6)
  assert aux["expert_load"].shape == (2, 4)


def test_remat_and_bfloat16_run():
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 8), 0, TINY.vocab_size)
  params = _init(TINY, tokens)
  loss = lambda cfg: lambda p: jnp.mean(Decoder(cfg).apply(p, tokens, train=True)[0])
  g_plain = jax.jit(jax.grad(loss(TINY)))(params)
  g_remat = jax.jit(jax.grad(loss(TINY.replace(remat_policy="dots_saveable"))))(params)
  for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  logits, _ = _apply(TINY.replace(dtype="bfloat16"))(params, tokens)
  assert logits.dtype == jnp.float32 and np.all(np.isfinite(logits))


def test_config_validation_messages():
  with pytest.raises(ValueError, match="mlp_kind"):  # when the model is built
    Decoder(ModelConfig(vocab_size=8, mlp_kind="relu")).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="top_k"):
    MoeConfig(num_experts=2, top_k=3)
  with pytest.raises(ValueError, match="vocab_size"):
    Decoder(ModelConfig()).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))


def test_explicit_layer_pattern_and_its_scan_unit():
  two_dense = ModelConfig(num_layers=6, layer_pattern="DDMMMM")
  assert two_dense.sparse_layers() == (False, False, True, True, True, True)
  assert scan_unit_length(two_dense) == 1
  assert layer_segments(two_dense.sparse_layers(), 1) == [((False,), 2), ((True,), 4)]
  alternating = ModelConfig(num_layers=6, layer_pattern="DMDMDM", sparse_interval=3)
  assert scan_unit_length(alternating) == 2
  assert scan_unit_length(ModelConfig(num_layers=12, sparse_interval=4)) == 4
  assert scan_unit_length(ModelConfig(num_layers=1, layer_pattern="M")) == 1
  assert scan_unit_length(ModelConfig(num_layers=3, sparse_interval=0)) == 1  # dense
  for bad in ("DMX", "DM"):
    with pytest.raises(ValueError, match="layer_pattern"):
      ModelConfig(num_layers=3, layer_pattern=bad)


def test_layer_pattern_expert_choice_and_jitter_through_the_objective():
  cfg = TINY.replace(num_layers=3, layer_pattern="DMM", moe=TINY.moe.replace(
      router=ExpertChoiceRouter(level="sequence", jitter_noise=0.1),
      capacity_factor_train=1.0, tokenwise_lb_loss_weight=0.01, num_shared_experts=1))
  tokens = jax.random.randint(jax.random.PRNGKey(6), (2, 8), 0, cfg.vocab_size)
  params = _init(cfg, tokens)
  assert set(params["params"]) >= {"layers_0", "layers_1"}
  assert params["params"]["layers_1"]["block_0"]["moe"]["router"]["w"].shape == (2, 16, 4)
  batch = {"decoder_input_tokens": tokens, "decoder_target_tokens": tokens,
           "decoder_loss_weights": jnp.ones_like(tokens, jnp.float32)}
  run = jax.jit(lambda p, r: CausalLm()(Decoder(cfg), p["params"], batch, r, train=True))
  loss, metrics = run(params, jax.random.PRNGKey(0))
  loss2, _ = run(params, jax.random.PRNGKey(1))
  assert np.isfinite(loss) and float(loss) != float(loss2)  # jitter differs per rng
  assert float(metrics["moe/tokenwise_lb_loss"]) > 0
  assert float(metrics["moe/experts_per_token_mean"]) == pytest.approx(2.0)


# --- Router losses through the Decoder against NumPy ---------------------------------


def _router_logits(cfg, params, tokens_bt):
  """Returns (aux, [each MoE layer's router logits [g, s, E] as float64 numpy]).

  `cfg` must have scan_layers=False: logits captured inside a scan cannot leave it.
  """
  def run(params, tokens_bt):
    captured = []

    def keep_router_output(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if isinstance(context.module, RouterLogits) and context.method_name == "__call__":
        captured.append(out)
      return out
    with nn.intercept_methods(keep_router_output):
      _, aux = Decoder(cfg).apply(params, tokens_bt, train=True)
    return aux, captured
  aux, captured = jax.jit(run)(params, tokens_bt)
  return aux, [np.asarray(l, np.float64) for l in captured]


def _np_load_balancing(logits_gse, top_k):
  """ST-MoE / flaxformer: E^2 x mean_e(share of tokens with e in their top-k x mean
  prob of e), per group, averaged over groups."""
  num_experts = logits_gse.shape[-1]
  probs = np.exp(logits_gse - logits_gse.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top_gsk = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]
  chose_gse = (top_gsk[..., None] == np.arange(num_experts)).any(-2)
  per_group = (chose_gse.mean(1) * probs.mean(1)).mean(-1) * num_experts ** 2
  return per_group.mean()


def _np_tokenwise(logits_use, top_k, capacity):
  """OpenMoE 2's token-wise loss with expert-choice routing per unit (oracle)."""
  units, t, num_experts = logits_use.shape
  total = 0.0
  for logits in logits_use:
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    kept, _ = reference_expert_choice(scores, capacity, t)
    over_tokens = np.exp(logits - logits.max(0, keepdims=True))
    over_tokens /= over_tokens.sum(0, keepdims=True)
    total += np.sum(over_tokens.sum(-1) * kept.sum(-1))
  return total / units / (num_experts * top_k)


def _np_lse_squared(logits_gse):
  peak = logits_gse.max(-1, keepdims=True)
  lse = np.log(np.exp(logits_gse - peak).sum(-1)) + peak[..., 0]
  return np.mean(lse ** 2)


@pytest.mark.parametrize("router", ["token_choice", "expert_choice"])
def test_decoder_router_losses_match_numpy(router):
  """aux_loss = mean over MoE layers of lb x 0.01 + z x 1e-4 (+ token-wise x w)."""
  t = 8
  moe = TINY.moe.replace(group_size=t, min_capacity=1, router_init_std=1.0)
  if router == "expert_choice":
    moe = moe.replace(router=ExpertChoiceRouter(level="sequence"),
                      capacity_factor_train=1.0, tokenwise_lb_loss_weight=0.03)
  cfg = TINY.replace(num_layers=4, sparse_interval=2, scan_layers=False, moe=moe)
  tokens = jax.random.randint(jax.random.PRNGKey(7), (3, t), 0, cfg.vocab_size)
  aux, logits = _router_logits(cfg, _init(cfg, tokens), tokens)
  assert len(logits) == 2 and logits[0].shape == (3, t, 4)  # 2 layers, 3 groups
  z = np.mean([_np_lse_squared(l) for l in logits])
  if router == "token_choice":
    lb = np.mean([_np_load_balancing(l, cfg.moe.top_k) for l in logits])
    tokenwise = 0.0
  else:
    lb = 0.0
    capacity = min(max(round(1.0 * cfg.moe.top_k * t / 4), 1), t)
    tokenwise = np.mean([_np_tokenwise(l, cfg.moe.top_k, capacity) for l in logits])
  expected = 0.01 * lb + 1e-4 * z + cfg.moe.tokenwise_lb_loss_weight * tokenwise
  assert float(aux["lb_loss"]) == pytest.approx(lb, rel=1e-5, abs=1e-7)
  assert float(aux["z_loss"]) == pytest.approx(z, rel=1e-5)
  assert float(aux["tokenwise_lb_loss"]) == pytest.approx(tokenwise, rel=1e-5, abs=1e-7)
  assert float(aux["aux_loss"]) == pytest.approx(expected, rel=1e-5)
  assert z > 1.0 and (lb > 1.0 or tokenwise > 0.5)  # every term is material


def test_rms_norm_adds_its_own_epsilon_under_the_root():
  """x = [1, 1, 1, 1] (mean square 1), eps 0.5: x / sqrt(1 + 0.5) times the scale."""
  norm = RMSNorm(eps=0.5)
  x_btd = jnp.ones((1, 1, 4), jnp.float32)
  params = {"params": {"scale": jnp.asarray([1.0, 2.0, 3.0, 4.0])}}
  np.testing.assert_allclose(np.asarray(norm.apply(params, x_btd))[0, 0],
                             np.array([1.0, 2.0, 3.0, 4.0]) / np.sqrt(1.5), rtol=1e-6)


def test_rms_norm_of_bfloat16_inputs_is_computed_in_float32():
  """bfloat16 activations (8 bits of mantissa): the mean square, the root and the
  scaling run in float32, so the result equals float64 math on the same inputs to
  float32 precision (bfloat16 math would be off by ~1e-2 relative)."""
  x_btd = (jax.random.normal(jax.random.PRNGKey(0), (2, 3, 512)) * 3 + 1).astype(
      jnp.bfloat16)
  scale_d = np.linspace(0.5, 2.0, 512).astype(np.float32)
  got = RMSNorm(eps=1e-6).apply({"params": {"scale": jnp.asarray(scale_d)}}, x_btd)
  assert got.dtype == jnp.float32
  want = numpy_rms_norm(np.asarray(x_btd, np.float64), scale_d, 1e-6)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("scale_logits", [True, False])
def test_unscaled_attention_logits_fold_the_scale_into_the_query_init(scale_logits):
  """Query kernel init std: d^-1/2 like the key's when the logits are scaled by
  1/sqrt(head_dim); (d head_dim)^-1/2 (the key's / sqrt(head_dim)) when not."""
  d, heads, head_dim = 256, 4, 64
  layer = Attention(num_heads=heads, head_dim=head_dim, scale_logits=scale_logits)
  x_btd = jnp.ones((1, 2, d), jnp.float32)
  params = nn.unbox(layer.init(jax.random.PRNGKey(0), x_btd, jnp.zeros((1, 2), jnp.int32),
                               make_attention_mask("causal", 2))["params"])
  std_q, std_k = float(np.std(params["query"])), float(np.std(params["key"]))
  assert std_k == pytest.approx(d ** -0.5, rel=0.03)
  want = d ** -0.5 if scale_logits else (d * head_dim) ** -0.5
  assert std_q == pytest.approx(want, rel=0.03)


def test_every_weight_starts_at_t5s_fan_in_scale():
  """T5 / flaxformer initialisation: each kernel normal(fan_in^-1/2), the fan-in
  being what its product contracts (d for wi_0, wi_1, query, key, value and the head;
  d_ff or the expert's d_ff for wo; heads x head_dim for the attention output); the
  embedding normal(emb_init_std = 1.0), the router normal(0.02) (REFERENCE.md), norm
  scales ones. Every leaf is named here, so a new parameter must be added."""
  d, heads, head_dim, d_ff, expert_d_ff = 128, 4, 16, 256, 64
  cfg = ModelConfig(vocab_size=512, d_model=d, num_heads=heads, head_dim=head_dim,
                    d_ff=d_ff, num_layers=2, sparse_interval=2,
                    moe=MoeConfig(num_experts=16, expert_d_ff=expert_d_ff,
                                  group_size=4096, min_capacity=64))
  params = _init(cfg, jnp.zeros((1, 8), jnp.int32))["params"]
  want = {"embedding": 1.0, "head": d ** -0.5, "key": d ** -0.5, "value": d ** -0.5,
          "query": d ** -0.5 if cfg.scale_attention_logits else (d * head_dim) ** -0.5,
          "out": (heads * head_dim) ** -0.5, "wi_0": d ** -0.5, "wi_1": d ** -0.5,
          "w": 0.02}
  seen = set()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = [p.key for p in path]
    name = names[-1]
    if name == "scale":
      np.testing.assert_array_equal(leaf, np.ones_like(leaf))
      continue
    if name == "wo":
      expected = (expert_d_ff if "experts" in names else d_ff) ** -0.5
    else:
      expected = want[name]
    assert float(np.std(leaf)) == pytest.approx(expected, rel=0.05), names
    assert abs(float(np.mean(leaf))) < 0.05 * expected, names
    seen.add(("experts" in names, name))
  assert {name for _, name in seen} == set(want) | {"wo"}
  assert (True, "wo") in seen and (False, "wo") in seen


@pytest.mark.parametrize("residual_mlp", [True, False])
def test_dense_blocks_hold_an_mlp_and_sparse_ones_the_moe_and_the_residual_mlp(
    residual_mlp):
  """OpenMoE's sparse block is attention, the MoE and then (residual_mlp, its default)
  a dense MLP of its own; a dense block is attention and the MLP."""
  cfg = TINY.replace(num_layers=2, moe=TINY.moe.replace(residual_mlp=residual_mlp))
  unit = _init(cfg, jnp.zeros((1, 8), jnp.int32))["params"]["layers_0"]
  attention = {"pre_attention_norm", "attention"}
  mlp = {"pre_mlp_norm", "mlp"}
  assert set(unit["block_0"]) == attention | mlp
  assert set(unit["block_1"]) == attention | {"pre_moe_norm", "moe"} | (
      mlp if residual_mlp else set())


def test_each_scanned_layer_starts_from_its_own_draw_and_decoding_is_the_default():
  """nn.scan splits the init rng per repeat: no two layers of a scanned segment
  start equal. Without `train`, the decoder routes as in evaluation (capacity factor
  2.0), not with training's 0.5."""
  cfg = TINY.replace(moe=TINY.moe.replace(capacity_factor_train=0.5, min_capacity=1))
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 8), 0, cfg.vocab_size)
  params = _init(cfg, tokens)
  scanned = params["params"]["layers_0"]
  for path, leaf in jax.tree_util.tree_flatten_with_path(scanned)[0]:
    assert leaf.shape[0] == 2, path  # 4 layers as 2 repeats of (dense, sparse)
    if "scale" not in jax.tree_util.keystr(path):  # norm scales start at ones
      assert not np.allclose(leaf[0], leaf[1]), path
  default, _ = Decoder(cfg).apply(params, tokens)
  evaluation, _ = Decoder(cfg).apply(params, tokens, train=False)
  training, _ = Decoder(cfg).apply(params, tokens, train=True)
  np.testing.assert_array_equal(default, evaluation)
  assert not np.allclose(default, training, atol=1e-3)


def test_each_scanned_moe_layer_draws_its_own_router_jitter(monkeypatch):
  """nn.scan splits the "jitter" rng per repeat: the two MoE layers of TINY's scanned
  (dense, sparse) unit multiply their router inputs by different U(0.9, 1.1) noise."""
  from openmoe_jax.moe.layer import MoeLayer
  cfg = TINY.replace(moe=TINY.moe.replace(router=TokenChoiceRouter(jitter_noise=0.1)))
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 8), 0, cfg.vocab_size)
  params = _init(cfg, tokens)
  noises = []
  original = MoeLayer._jitter  # pylint: disable=protected-access

  def recording_jitter(self, x_gsd, router, train):
    y_gsd = original(self, x_gsd, router, train)
    jax.debug.callback(lambda y, x: noises.append(np.asarray(y) / np.asarray(x)),
                       y_gsd, x_gsd)
    return y_gsd

  monkeypatch.setattr(MoeLayer, "_jitter", recording_jitter)
  Decoder(cfg).apply(params, tokens, train=True, rngs={"jitter": jax.random.PRNGKey(5)})
  assert len(noises) == 2
  for noise in noises:
    assert np.all((noise > 0.9 - 1e-6) & (noise < 1.1 + 1e-6))
  assert not np.allclose(noises[0], noises[1], atol=1e-3)
