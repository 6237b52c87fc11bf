"""The model's parameter layout (`model.layer_slots`) is the one the Decoder builds,
and the routing recorder reads every gin preset and arm through it."""
import pathlib

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax import gin_utils
from openmoe_jax.analysis.record import make_routing_fn
from openmoe_jax.config import ModelConfig
from openmoe_jax.model import Decoder, get_layer, layer_slots, set_layer

GIN_ROOT = pathlib.Path(__file__).resolve().parents[1] / "gin"
MODEL_GIN_FILES = sorted(
    str(p.relative_to(GIN_ROOT)) for p in GIN_ROOT.rglob("*.gin")
    if p.parts[-2] != "objectives")


def _shrunk(cfg: ModelConfig) -> ModelConfig:
  """Returns `cfg` at toy width: same layers, layout, routing and expert count."""
  moe = cfg.moe.replace(
      expert_d_ff=8, group_size=16,
      shared_expert_d_ff=8 if cfg.moe.num_shared_experts else None)
  return cfg.replace(vocab_size=32, d_model=16, num_heads=2, head_dim=8, d_ff=16,
                     moe=moe, dtype="float32", remat_policy="none")


def _gin_model(name: str) -> ModelConfig:
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin([name], finalize=False)
  return ModelConfig()


def _param_block_paths(params):
  """Returns {(segment, block)} present in a Decoder's params."""
  return {(seg, blk) for seg, sub in params.items() if seg.startswith("layers_")
          for blk in sub}


@pytest.mark.parametrize("cfg", [
    ModelConfig(num_layers=8, sparse_interval=4),
    ModelConfig(num_layers=6, layer_pattern="DDMMMM"),
    ModelConfig(num_layers=4, layer_pattern="MMMM"),
    ModelConfig(num_layers=6, layer_pattern="DMDMMD", scan_layers=False),
], ids=["every4", "DDMMMM", "MMMM", "unscanned"])
def test_layer_slots_address_every_block_the_decoder_builds(cfg):
  cfg = _shrunk(cfg)
  params = jax.eval_shape(Decoder(cfg).init, jax.random.PRNGKey(0),
                          jnp.zeros((1, 16), jnp.int32))["params"]
  slots = layer_slots(cfg)
  assert [s.sparse for s in slots] == list(cfg.sparse_layers())
  assert {(s.segment, s.block) for s in slots} == _param_block_paths(params)
  for slot in slots:
    block = params[slot.segment][slot.block]
    assert ("moe" in block) == slot.sparse
    leaf = jax.tree.leaves(block)[0]
    if slot.repeat is not None:
      assert slot.repeat < leaf.shape[0]
  # Depth order: each (segment, block, repeat) appears once.
  assert len(set(slots)) == len(slots) == cfg.num_layers


def test_get_and_set_layer_address_one_layer_only():
  cfg = _shrunk(ModelConfig(num_layers=8, sparse_interval=4))
  params = jax.jit(Decoder(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))
  params = jax.tree.map(np.array, jax.device_get(nn.unbox(params["params"])))
  before = jax.tree.map(np.copy, params)
  slots = layer_slots(cfg)
  target = slots[5]
  zeros = jax.tree.map(np.zeros_like, get_layer(params, target))
  set_layer(params, target, zeros)
  for slot in slots:
    got = get_layer(params, slot)
    want = zeros if slot == target else get_layer(before, slot)
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("name", MODEL_GIN_FILES)
def test_routing_is_recorded_for_every_preset_and_arm(name):
  """Each recorded layer's routing reproduces that layer's own aux statistics
  (expert load from the chosen experts, experts per token from the kept options);
  a layer read from the wrong place, or layers out of order, would not."""
  cfg = _shrunk(_gin_model(name))
  b, t = 2, 16
  tokens = jax.random.randint(jax.random.PRNGKey(1), (b, t), 0, cfg.vocab_size)
  batch = {"decoder_input_tokens": tokens,
           "decoder_positions": jnp.broadcast_to(jnp.arange(t), (b, t)),
           "decoder_segment_ids": jnp.ones((b, t), jnp.int32)}
  routing_fn = make_routing_fn(cfg, train=False)

  @jax.jit  # one compile for init and routing
  def init_and_route(key):
    params = Decoder(cfg).init(key, tokens)["params"]
    return routing_fn(params, batch)

  if not any(cfg.sparse_layers()):  # the dense arm: nothing to record, said clearly
    with pytest.raises(ValueError, match="no MoE layer"):
      init_and_route(jax.random.PRNGKey(0))
    return
  routing, aux = jax.device_get(init_and_route(jax.random.PRNGKey(0)))
  num_moe = sum(cfg.sparse_layers())
  num_experts = cfg.moe.num_experts
  assert routing["expert_index"].shape[:3] == (num_moe, b, t)
  load_le = np.stack([
      np.bincount(e.ravel(), minlength=num_experts) / e.size
      for e in routing["expert_index"]])
  np.testing.assert_allclose(load_le, aux["expert_load"], atol=1e-6)
  per_token_l = routing["kept"].sum(-1).mean(axis=(1, 2))
  np.testing.assert_allclose(per_token_l, aux["experts_per_token_mean"], atol=1e-6)
