"""Attention implementations (layers/attention_impls.py) against the plain einsum +
softmax path: outputs and gradients of the attention layer for every mask kind
(causal, prefix, bidirectional; packed segments with padding), scaled and unscaled
logits, QK-norm; the whole decoder with the implementation switched in the config;
the default's per-platform choice; splash compiled for a TPU topology.

Splash attention runs here in Pallas interpret mode (its blocks are multiples of
128 tokens, so its cases use t = 256).
"""
import logging

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax import gin_utils, partitioning, plan
from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.kernels.target import compile_target
from openmoe_jax.layers.attention import Attention
from openmoe_jax.layers.attention_impls import (AutoAttention, PlainAttention,
                                                SplashAttention,
                                                XlaDotProductAttention,
                                                attention_impl_of, cudnn_supported)
from openmoe_jax.layers.attention_mask import AttentionMask, make_attention_mask
from openmoe_jax.model import Decoder

T = 256  # splash's smallest block is 128 tokens
# Each is checked against PlainAttention() (on the CPU: heads first for self-attention),
# including the plain einsums on [b, t, h, k] it runs on TPU and GPU.
IMPLS = {"xla": XlaDotProductAttention("xla"), "splash": SplashAttention(interpret=True),
         "plain_tokens_first": PlainAttention(heads_first=False)}


def _segments_bt() -> np.ndarray:
  """Returns packed segment ids [2, T]: 2 and 3 segments per row, padding (0) last."""
  row0 = [1] * 100 + [2] * 140 + [0] * 16
  row1 = [1] * 60 + [2] * 90 + [3] * 86 + [0] * 20
  return np.asarray([row0, row1], np.int32)


def _positions_bt(segments_bt: np.ndarray) -> np.ndarray:
  """Returns positions restarting at 0 in each segment."""
  positions = np.zeros_like(segments_bt)
  for row, seg in enumerate(segments_bt):
    for i in range(1, len(seg)):
      positions[row, i] = positions[row, i - 1] + 1 if seg[i] == seg[i - 1] else 0
  return positions


def _prefix_bt(segments_bt: np.ndarray) -> np.ndarray:
  """Returns prefix flags: the first third of each non-padding segment."""
  prefix = np.zeros_like(segments_bt)
  for row, seg in enumerate(segments_bt):
    for s in set(seg.tolist()) - {0}:
      where = np.flatnonzero(seg == s)
      prefix[row, where[:len(where) // 3]] = 1
  return prefix


MASKS = {  # name -> (kind, packed)
    "causal": ("causal", False), "causal_packed": ("causal", True),
    "prefix_packed": ("prefix", True), "bidirectional": ("bidirectional", False),
    "bidirectional_packed": ("bidirectional", True)}


def _mask(name: str) -> AttentionMask:
  kind, packed = MASKS[name]
  seg = _segments_bt()
  return AttentionMask.build(kind, jnp.asarray(seg) if packed else None,
                             jnp.asarray(_prefix_bt(seg)) if kind == "prefix" else None)


def _layer_outputs_and_grads(impl, mask, scale_logits, qk_norm=False):
  """Returns (out [2, T, d], grads of sum(out * w) for the params and the input)."""
  layer = Attention(num_heads=2, head_dim=8, qk_norm=qk_norm,
                    scale_logits=scale_logits, impl=impl)
  x_btd = jax.random.normal(jax.random.PRNGKey(0), (2, T, 16))
  pos_bt = jnp.asarray(_positions_bt(_segments_bt()))
  params = nn.unbox(layer.init(jax.random.PRNGKey(1), x_btd, pos_bt, mask))
  w_btd = jax.random.normal(jax.random.PRNGKey(2), x_btd.shape)

  def loss(params, x_btd):
    return jnp.sum(layer.apply(params, x_btd, pos_bt, mask) * w_btd)

  out = jax.jit(layer.apply)(params, x_btd, pos_bt, mask)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x_btd)
  return out, grads


def _assert_close(got, want, tol=1e-5):
  """Asserts equal leaves to `tol`, absolute on the scale of each leaf's largest
  entry (splash's blockwise softmax sums in another order: unscaled logits give
  gradients up to ~50 where a small entry then differs by ~2e-5)."""
  def check(g, w):
    scale = max(1.0, float(np.max(np.abs(w))))
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)
  jax.tree.map(check, got, want)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("scale_logits", [True, False])
def test_implementation_equals_plain_outputs_and_gradients(impl, mask_name,
                                                           scale_logits):
  mask = _mask(mask_name)
  got = _layer_outputs_and_grads(IMPLS[impl], mask, scale_logits)
  want = _layer_outputs_and_grads(PlainAttention(), mask, scale_logits)
  _assert_close(got, want)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_implementation_equals_plain_with_qk_norm(impl):
  mask = _mask("causal_packed")
  got = _layer_outputs_and_grads(IMPLS[impl], mask, True, qk_norm=True)
  want = _layer_outputs_and_grads(PlainAttention(), mask, True, qk_norm=True)
  _assert_close(got, want)


def test_packed_segments_and_padding_are_isolated():
  # The packed mask is not vacuous: its plain output differs from the unpacked one
  # in every segment after the first, and splash agrees with plain on it.
  seg = _segments_bt()
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, T, 2, 8)) for i in range(3))
  packed = AttentionMask.build("causal", jnp.asarray(seg))
  plain = PlainAttention()(q, k, v, packed, 0.5)
  unpacked = PlainAttention()(q, k, v, AttentionMask.build("causal"), 0.5)
  later = seg[:, :, None, None].repeat(2, 2).repeat(8, 3) > 1
  assert np.all(np.abs(np.asarray(plain - unpacked))[later].reshape(-1, 8).max(-1) > 0)
  for impl in IMPLS.values():
    np.testing.assert_allclose(impl(q, k, v, packed, 0.5), plain, atol=1e-5)


def test_kv_cache_decoding_equals_causal_attention_over_the_whole_sequence():
  """A 3-token prefill, then one token per call through the KV cache, gives each
  position the output of one causal pass over all 7 tokens: 4 heads (not 2, so a
  cache mask built with the head count in place of its 1 cannot broadcast), 2 rows
  at once, QK-norm and RoPE at each call's own positions."""
  layer = Attention(num_heads=4, head_dim=8, qk_norm=True)
  b, t = 2, 7
  x_btd = jax.random.normal(jax.random.PRNGKey(0), (b, t, 16))
  pos_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
  causal = AttentionMask.build("causal")
  params = nn.unbox(layer.init(jax.random.PRNGKey(1), x_btd, pos_bt, causal))
  want_btd = layer.apply(params, x_btd, pos_bt, causal)

  cache = jax.tree.map(jnp.zeros_like, layer.apply(
      params, x_btd, pos_bt, causal, mutable=["cache"])[1]["cache"])
  got = []
  for lo, hi in [(0, 3)] + [(i, i + 1) for i in range(3, t)]:
    out_btd, state = layer.apply({**params, "cache": cache}, x_btd[:, lo:hi],
                                 pos_bt[:, lo:hi], causal, mutable=["cache"])
    cache = state["cache"]
    got.append(out_btd)
  assert int(cache["index"]) == t
  np.testing.assert_allclose(jnp.concatenate(got, axis=1), want_btd, atol=1e-5)


def test_attention_mask_dense_matches_make_attention_mask():
  seg, prefix = jnp.asarray(_segments_bt()), jnp.asarray(_prefix_bt(_segments_bt()))
  for kind in ("causal", "prefix", "bidirectional"):
    mask = AttentionMask.build(kind, seg, prefix if kind == "prefix" else None)
    np.testing.assert_array_equal(
        mask.dense(2, T), make_attention_mask(kind, T, seg, prefix, 2))
  # Without segment ids: one lower-triangular mask for a batch of 1.
  np.testing.assert_array_equal(make_attention_mask("causal", 3),
                                np.tril(np.ones((1, 1, 3, 3), bool)))
  with pytest.raises(ValueError, match="prefix flags"):
    AttentionMask.build("prefix", seg)
  with pytest.raises(ValueError, match="unknown attention kind"):
    AttentionMask.build("sideways")


def test_splash_hands_what_it_cannot_serve_to_its_fallback(caplog):
  splash = SplashAttention(interpret=True)
  q = jax.random.normal(jax.random.PRNGKey(0), (2, T, 2, 8))
  assert splash.handles(_mask("causal_packed"), q, q)
  assert splash.handles(_mask("bidirectional"), q, q)
  assert not splash.handles(_mask("prefix_packed"), q, q)
  assert not splash.handles(AttentionMask.explicit(jnp.ones((1, 1, T, T), bool)), q, q)
  short = q[:, :200]  # model init traces short dummy inputs
  assert not splash.handles(_mask("causal"), short, short)
  with caplog.at_level(logging.INFO):
    splash(q, q, q, _mask("prefix_packed"), 1.0)
    out = splash(short, short, short, AttentionMask.build("causal"), 0.5)
  assert caplog.text.count("using the fallback") == 2
  np.testing.assert_allclose(
      out, PlainAttention()(short, short, short, AttentionMask.build("causal"), 0.5),
      atol=1e-5)


def test_bad_settings_are_rejected():
  with pytest.raises(ValueError, match="block_size"):
    SplashAttention(block_size=100)
  with pytest.raises(ValueError, match="implementation"):
    XlaDotProductAttention("flash")


def test_auto_attention_picks_per_platform():
  auto = AutoAttention()
  q = lambda t, d: jax.ShapeDtypeStruct((1, t, 2, d), jnp.bfloat16)
  assert isinstance(auto.choose(q(256, 128), q(256, 128)), PlainAttention)  # CPU
  with compile_target("TPU v5"):
    assert isinstance(auto.choose(q(256, 128), q(256, 128)), SplashAttention)
    assert isinstance(auto.choose(q(200, 128), q(200, 128)), XlaDotProductAttention)
    assert isinstance(auto.choose(q(256, 64), q(256, 64)), SplashAttention)
    assert isinstance(auto.choose(q(256, 96), q(256, 96)), XlaDotProductAttention)
  assert isinstance(attention_impl_of(None), AutoAttention)
  assert isinstance(attention_impl_of(PlainAttention()), PlainAttention)


TINY = ModelConfig(vocab_size=64, d_model=16, num_heads=2, head_dim=8, d_ff=24,
                   num_layers=2, sparse_interval=2,
                   moe=MoeConfig(num_experts=4, group_size=4096, min_capacity=64))


@pytest.mark.parametrize("impl", [None, "xla", "splash"])
def test_decoder_logits_equal_with_the_implementation_switched(impl):
  seg = jnp.asarray(_segments_bt())
  tokens = jax.random.randint(jax.random.PRNGKey(3), seg.shape, 0, TINY.vocab_size)
  arrays = dict(positions_bt=jnp.asarray(_positions_bt(_segments_bt())),
                segment_ids_bt=seg)
  plain_cfg = TINY.replace(attention_impl=PlainAttention())
  params = nn.unbox(Decoder(plain_cfg).init(jax.random.PRNGKey(0), tokens, **arrays))
  run = lambda cfg: jax.jit(Decoder(cfg).apply)(params, tokens, **arrays)[0]
  cfg = TINY.replace(attention_impl=None if impl is None else IMPLS[impl])
  np.testing.assert_allclose(run(cfg), run(plain_cfg), rtol=1e-5, atol=1e-5)


def test_gin_binds_the_implementation():
  gin_utils.import_configurables()
  gin.parse_config(["ModelConfig.attention_impl = @SplashAttention()",
                    "SplashAttention.block_size = 256"])
  assert ModelConfig().attention_impl == SplashAttention(block_size=256)
  assert ModelConfig(attention_impl=None).attention_impl is None


def _tpu_attention_temp_bytes(devices, impl, t) -> int:
  """Returns the per-device temporary bytes of jit(grad) of `impl` on a bf16 causal
  packed batch [2 x devices, t, 4 heads, 128] split over the devices, compiled for
  their TPU;
  asserts that splash compiled to Mosaic kernels (no silent fallback)."""
  mesh = partitioning.make_mesh(devices=devices, data=len(devices))
  sharding = partitioning.logical_sharding(mesh, "batch")
  b = 2 * len(devices)
  q = jax.ShapeDtypeStruct((b, t, 4, 128), jnp.bfloat16, sharding=sharding)
  seg = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=sharding)

  def loss(q, k, v, seg):
    out = impl(q, k, v, AttentionMask.build("causal", seg), 1.0)
    return jnp.sum(out.astype(jnp.float32))

  with partitioning.activate(mesh), compile_target(devices[0]):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q, seg).compile()
  mosaic_calls = compiled.as_text().count("custom_call_target=\"tpu_custom_call\"")
  assert (mosaic_calls > 0) == isinstance(impl, SplashAttention)
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("topology", ["v3:2x2", "v5p:2x2x1"])
def test_splash_compiles_for_a_tpu_topology_and_saves_memory(topology):
  # v3: bf16 inputs are upcast (Mosaic there has no bf16 matmuls).
  pytest.importorskip("libtpu")
  devices = plan.topology_devices(topology)
  splash = _tpu_attention_temp_bytes(devices, SplashAttention(), 4096)
  plain = _tpu_attention_temp_bytes(devices, PlainAttention(), 4096)
  # Plain holds [2, 4, 4096, 4096] float32 logits (and probabilities) per device;
  # splash only blocks of them (its temporaries are mostly q, k, v and gradients).
  logits_bytes = 2 * 4 * 4096 * 4096 * 4
  assert plain > logits_bytes > 4 * splash


def test_planner_reports_the_attention_implementation():
  pytest.importorskip("libtpu")
  gin_utils.import_configurables()
  gin_utils.parse_gin(["models/quickstart_moe.gin"], [
      "ModelConfig.vocab_size = 512", "ModelConfig.d_model = 128",
      "ModelConfig.num_heads = 2", "ModelConfig.head_dim = 128",
      "ModelConfig.num_layers = 2", "ModelConfig.d_ff = 256",
      "MoeConfig.num_experts = 8", "MoeConfig.group_size = 256",
      "make_mesh.data = 2", "make_mesh.fsdp = 2"], finalize=False)
  report = plan.plan("v5p:2x2x1", batch_size=8, sequence_length=256)
  assert report["attention"] == "AutoAttention -> SplashAttention"
  assert report["fits"]


def test_plain_attention_moves_heads_first_only_for_cpu_self_attention():
  q = jnp.ones((2, 16, 2, 8))

  def transposes(impl, k, mask=AttentionMask.build("causal", None)):
    jaxpr = jax.make_jaxpr(lambda q, k: impl(q, k, k, mask, 1.0))(q, k)
    return sum(eqn.primitive.name == "transpose" for eqn in jaxpr.jaxpr.eqns)

  tokens_first = transposes(PlainAttention(heads_first=False), q)
  # Heads first: q, k and v moved before the products, the output back after.
  assert transposes(PlainAttention(), q) == tokens_first + 3
  with compile_target("TPU v5"):  # a TPU program keeps XLA's own layouts
    assert transposes(PlainAttention(), q) == tokens_first
    assert transposes(PlainAttention(heads_first=True), q) == tokens_first + 3
  # 16 queries against a cache of 32 keys: the einsums on [b, t, h, k], no copies.
  cache = jnp.ones((2, 32, 2, 8))
  explicit = AttentionMask.explicit(jnp.ones((2, 1, 16, 32), bool))
  assert transposes(PlainAttention(), cache, explicit) == transposes(
      PlainAttention(heads_first=False), cache, explicit)


def test_cudnn_serves_half_precision_head_dims_up_to_128_on_gpu(monkeypatch):
  """cuDNN flash attention: GPU backend, bf16/fp16, head_dim a multiple of 8 up to
  and including 128; never float32, never on the CPU."""
  q = lambda d, dtype=jnp.bfloat16: jax.ShapeDtypeStruct((1, 16, 2, d), dtype)
  assert not cudnn_supported(q(128))  # this CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert cudnn_supported(q(128)) and cudnn_supported(q(64))
  assert cudnn_supported(q(128, jnp.float16))
  assert not cudnn_supported(q(136)) and not cudnn_supported(q(60))
  assert not cudnn_supported(q(128, jnp.float32))


def test_auto_tries_cudnn_where_supported_and_falls_back_to_xla(monkeypatch, caplog):
  """Where cuDNN should serve (faked here) but its call fails (this CPU has no cuDNN:
  jax raises RuntimeError), the default implementation logs why and runs XLA's,
  which equals the plain path."""
  from openmoe_jax.layers import attention_impls  # pylint: disable=g-import-not-at-top
  tried, dot_product_attention = [], jax.nn.dot_product_attention

  def recording(*args, implementation=None, **kwargs):
    tried.append(implementation)
    return dot_product_attention(*args, implementation=implementation, **kwargs)

  monkeypatch.setattr(attention_impls, "cudnn_supported", lambda q: True)
  monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
  q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 16, 2, 8), jnp.bfloat16)
  mask = AttentionMask.build("causal")
  with caplog.at_level(logging.WARNING):
    out = XlaDotProductAttention()(q, k, v, mask, 0.5)
  assert tried == ["cudnn", "xla"]
  assert "cuDNN attention unavailable (cuDNN is not detected.); using XLA's" in caplog.text
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(
      PlainAttention()(q, k, v, mask, 0.5), np.float32), atol=2e-2)
  tried.clear()  # asked for by name: no attempt at cuDNN
  XlaDotProductAttention("xla")(q, k, v, mask, 0.5)
  assert tried == ["xla"]
