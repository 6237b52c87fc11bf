"""Decoder: masks, causality, packing, layer layout, scan and remat equivalence."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.layers.attention import make_attention_mask
from openmoe_jax.layers.embeddings import Embed
from openmoe_jax.model import Decoder, layer_segments, scan_unit_length
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter
from openmoe_jax.objectives import CausalLm

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


def _logits_from_embeddings(cfg, params, tokens_bt, **kwargs):
  """Returns f(x_btd) -> logits with the embedding output replaced by x_btd."""
  def f(x_btd):
    def swap_embedding(next_fun, args, fn_kwargs, context):
      if isinstance(context.module, Embed) and context.method_name == "__call__":
        return x_btd
      return next_fun(*args, **fn_kwargs)
    with nn.intercept_methods(swap_embedding):
      return Decoder(cfg).apply(params, tokens_bt, **kwargs)[0]
  return f


@pytest.mark.parametrize("capacity", [64, 1])  # ample, and overflowing experts
def test_causal_model_gradient_is_zero_from_future_positions(capacity):
  cfg = TINY.replace(moe=TINY.moe.replace(min_capacity=capacity,
                                           capacity_factor_train=0.25))
  t = 8
  tokens = jnp.arange(t)[None] % cfg.vocab_size
  params = _init(cfg, tokens)
  x_btd = jax.random.normal(jax.random.PRNGKey(1), (1, t, cfg.d_model))
  jac = jax.jit(jax.jacrev(_logits_from_embeddings(cfg, params, tokens, train=True)))(
      x_btd)
  sensitivity_ts = np.abs(np.asarray(jac)).sum(axis=(0, 2, 3, 5))  # [t_out, s_in]
  assert np.all(sensitivity_ts[np.triu_indices(t, k=1)] == 0)
  assert np.all(np.diag(sensitivity_ts) > 0)
  assert sensitivity_ts[t - 1, 0] > 0


def test_changing_a_future_token_leaves_past_logits_unchanged():
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, TINY.vocab_size)
  params = _init(TINY, tokens)
  apply = _apply(TINY, train=False)
  logits = apply(params, tokens)[0]
  changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % TINY.vocab_size)
  logits2 = apply(params, changed)[0]
  np.testing.assert_array_equal(logits[:, :7], logits2[:, :7])
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
  with pytest.raises(ValueError, match="mlp_kind"):
    ModelConfig(mlp_kind="relu")
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
