"""Sparse upcycling: dense FFNs become experts that reproduce the dense model."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.layers.mlp import Mlp
from openmoe_jax.moe.dispatch.base import expert_mlp
from openmoe_jax.moe.experts import Experts
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter
from openmoe_jax.model import Decoder, get_layer, layer_slots
from openmoe_jax.upcycle import split_ffn_into_experts, upcycle_params

DENSE = ModelConfig(vocab_size=64, d_model=16, num_heads=2, head_dim=8, d_ff=24,
                    num_layers=4, mlp_kind="swiglu", layer_pattern="DDDD")


# Jitted: op by op, the unscanned model took 3 minutes on a slow 2-core CPU.
def _init(cfg, seed):
  tokens = jnp.zeros((1, 8), jnp.int32)
  return jax.device_get(nn.unbox(
      jax.jit(Decoder(cfg).init)(jax.random.PRNGKey(seed), tokens)["params"]))


def _logits(cfg, params, tokens):
  return np.asarray(jax.jit(Decoder(cfg).apply)({"params": params}, tokens)[0])


@pytest.mark.parametrize("pattern,scan", [("MMMM", True), ("DMDM", True),
                                          ("DDMM", False)])
def test_identical_expert_copies_reproduce_the_dense_model(pattern, scan):
  # Every expert a copy of the dense FFN; gates renormalised over the top-k and no
  # drops, so any routing computes exactly the dense FFN.
  dense_cfg = DENSE.replace(scan_layers=scan)
  moe_cfg = dense_cfg.replace(layer_pattern=pattern, moe=MoeConfig(
      num_experts=4, top_k=2, group_size=16, renormalize_gates=True,
      residual_mlp=False, router=TokenChoiceRouter(dropless=True)))
  dense = _init(dense_cfg, 0)
  moe = upcycle_params(dense, dense_cfg, _init(moe_cfg, 1), moe_cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, 64)
  np.testing.assert_allclose(_logits(moe_cfg, moe, tokens),
                             _logits(dense_cfg, dense, tokens), rtol=1e-5, atol=1e-5)
  # The router is the MoE model's fresh one, not a copy of anything dense.
  slot = layer_slots(moe_cfg)[moe_cfg.sparse_layers().index(True)]
  fresh = _init(moe_cfg, 1)[slot[0]][slot[1]]["moe"]["router"]
  got = moe[slot[0]][slot[1]]["moe"]["router"]
  jax.tree.map(np.testing.assert_array_equal, got, fresh)


@pytest.mark.parametrize("kind", ["swiglu", "openmoe_swiglu", "geglu"])
def test_fine_grained_slices_sum_to_the_dense_ffn(kind):
  d, d_ff, expert_d_ff, num_experts = 16, 32, 8, 8  # 4 slices, each held twice
  x_nd = jax.random.normal(jax.random.PRNGKey(0), (10, d))
  mlp = Mlp(kind, d_ff)
  mlp_params = nn.unbox(mlp.init(jax.random.PRNGKey(1), x_nd[None])["params"])
  dense_nd = mlp.apply({"params": mlp_params}, x_nd[None])[0]
  experts = split_ffn_into_experts(jax.device_get(mlp_params), kind, num_experts,
                                   expert_d_ff)
  assert experts["wi_1"].shape == (num_experts, d, expert_d_ff)
  x_end = jnp.broadcast_to(x_nd, (num_experts,) + x_nd.shape)
  y_end = expert_mlp(Experts(num_experts, kind, expert_d_ff).apply({"params": experts}, d),
                     x_end)
  # Experts e and e + 4 hold the same slice: one of each slice with weight 1 is the
  # dense FFN.
  np.testing.assert_array_equal(experts["wo"][1], experts["wo"][5])
  for chosen in ([0, 1, 2, 3], [4, 1, 6, 3]):
    np.testing.assert_allclose(np.sum(np.asarray(y_end)[chosen], axis=0), dense_nd,
                               rtol=1e-5, atol=1e-6)


def test_incompatible_models_are_refused():
  dense = _init(DENSE, 0)
  residual = DENSE.replace(layer_pattern="MMMM", moe=MoeConfig(num_experts=4))
  with pytest.raises(ValueError, match="residual_mlp = False"):
    upcycle_params(dense, DENSE, _init(residual, 1), residual)
  wider = DENSE.replace(d_model=32, layer_pattern="MMMM",
                        moe=MoeConfig(num_experts=4, residual_mlp=False))
  with pytest.raises(ValueError, match="d_model: dense 16 vs MoE 32"):
    upcycle_params(dense, DENSE, _init(wider, 1), wider)
  moe = DENSE.replace(layer_pattern="MMMM", moe=MoeConfig(num_experts=4, residual_mlp=False))
  half = moe.replace(layer_pattern="DMDM")  # one MoE layer is enough to refuse
  with pytest.raises(ValueError, match="the dense checkpoint has MoE layers; upcycling "
                     "needs a dense model"):
    upcycle_params(_init(half, 0), half, _init(moe, 1), moe)
  mlp = get_layer(dense, layer_slots(DENSE)[0])["mlp"]
  for expert_d_ff, slices in [(3, "8"), (5, "4.8")]:  # neither fills 4 experts
    with pytest.raises(ValueError, match=re.escape(
        f"a dense FFN of d_ff 24 into 4 experts of {expert_d_ff}: need expert_d_ff to "
        f"divide d_ff and d_ff / expert_d_ff ({slices}) to divide num_experts")):
      split_ffn_into_experts(mlp, "swiglu", 4, expert_d_ff)


def test_norm_scales_are_copied_to_their_own_places():
  """Norm scales that differ from the initial ones (and from each other) go to
  their own places: each layer's attention norm to its attention norm, the dense
  MLP's norm to the MoE layer's pre_moe_norm (a dense layer's pre_mlp_norm), and
  the final norm to the final norm."""
  dense_cfg = DENSE.replace(scan_layers=False)
  moe_cfg = dense_cfg.replace(layer_pattern="DDMM", moe=MoeConfig(
      num_experts=4, top_k=2, group_size=16, residual_mlp=False))
  rng = np.random.default_rng(0)
  dense = jax.tree_util.tree_map_with_path(
      lambda path, a: (rng.standard_normal(a.shape).astype(a.dtype)
                       if "norm" in jax.tree_util.keystr(path) else a),
      _init(dense_cfg, 0))
  moe = upcycle_params(dense, dense_cfg, _init(moe_cfg, 1), moe_cfg)
  same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
  same(moe["final_norm"], dense["final_norm"])
  for dense_slot, moe_slot in zip(layer_slots(dense_cfg), layer_slots(moe_cfg)):
    d, m = get_layer(dense, dense_slot), get_layer(moe, moe_slot)
    same(m["pre_attention_norm"], d["pre_attention_norm"])
    same(m["pre_moe_norm" if moe_slot.sparse else "pre_mlp_norm"], d["pre_mlp_norm"])


def test_the_command_hands_its_flags_to_upcycle(monkeypatch):
  from openmoe_jax.cli import upcycle as upcycle_cli  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(upcycle_cli, "upcycle", lambda *args, **kwargs: calls.append(
      (args, kwargs)))
  gin = ["--gin_file=runs/ablate_tiny.gin", "--gin_file=experiments/openmoe2/upcycled.gin",
         "--gin.TRAIN_STEPS=3"]
  assert upcycle_cli.main(["--dense_checkpoint=/d", "--output=/o", *gin]) == 0
  assert calls.pop() == (("/d", "/o", ["runs/ablate_tiny.gin",
                                       "experiments/openmoe2/upcycled.gin"],
                          ["TRAIN_STEPS = 3"]), {"step": None, "seed": 0})
  assert upcycle_cli.main(["--dense_checkpoint=/d", "--output=/o", "--step=0",
                           "--seed=7", *gin]) == 0
  assert calls.pop()[1] == {"step": 0, "seed": 7}
