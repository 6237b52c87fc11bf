"""Every gin file under gin/ parses and builds its model abstractly (jax.eval_shape:
no parameter memory) with exactly the parameters an independent count predicts."""
import math
import pathlib

import gin
import jax
import jax.numpy as jnp
import pytest

from openmoe_jax import gin_utils
from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.model import Decoder
from openmoe_jax.moe.layer import router_of
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter

GIN_ROOT = pathlib.Path(__file__).resolve().parents[1] / "gin"
GIN_FILES = sorted(str(p.relative_to(GIN_ROOT)) for p in GIN_ROOT.rglob("*.gin"))


def test_gin_folder_is_not_empty():
  assert {"runs/quickstart.gin", "models/quickstart_moe.gin",
          "objectives/causal_lm.gin"} <= set(GIN_FILES)


def expected_param_count(cfg: ModelConfig) -> int:
  """Returns the parameter count of `cfg`'s decoder, from the architecture alone.

  Embedding table + untied head + final norm; per layer an RMSNorm and attention
  (q, k, v, out of d x h x d_h; QK-norm scales of d_h), then for a dense layer an
  RMSNorm and the gated MLP, for an MoE layer an RMSNorm, the router (d x E, plus
  d x S rows for gated shared experts), E routed and S shared gated MLPs, and with
  the residual MLP one more RMSNorm and dense MLP. A gated MLP of width f has
  wi_0 (d x 2f for OpenMoE's SwiGLU, else d x f), wi_1 (d x f) and wo (f x d).
  """
  d, moe = cfg.d_model, cfg.moe
  wi_0 = 2 if cfg.mlp_kind == "openmoe_swiglu" else 1
  mlp = lambda f: d * wi_0 * f + d * f + f * d
  attention = d + 4 * d * cfg.num_heads * cfg.head_dim + 2 * cfg.head_dim * cfg.qk_norm
  dense = attention + d + mlp(cfg.d_ff)
  expert_f = moe.expert_d_ff or cfg.d_ff
  shared = moe.num_shared_experts
  router = d * (moe.num_experts + (shared if moe.shared_experts_gated else 0))
  sparse = (attention + d + router + moe.num_experts * mlp(expert_f)
            + shared * mlp(moe.shared_expert_d_ff or expert_f)
            + (d + mlp(cfg.d_ff)) * moe.residual_mlp)
  k = cfg.sparse_interval
  pattern = cfg.layer_pattern or "".join(
      "M" if k and i >= cfg.num_dense_first and i % k == k - 1 else "D"
      for i in range(cfg.num_layers))
  return (2 * cfg.vocab_size * d + d + pattern.count("D") * dense
          + pattern.count("M") * sparse)


@pytest.mark.parametrize("name", GIN_FILES)
def test_gin_file_parses_and_builds_model_with_the_expected_parameters(name):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin([name], finalize=False)
  cfg = ModelConfig()
  if cfg.vocab_size is None:
    cfg = cfg.replace(vocab_size=8320)
  seq = min(cfg.moe.group_size, 128)
  tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  variables = jax.eval_shape(Decoder(cfg).init, jax.random.PRNGKey(0), tokens)
  assert set(variables) == {"params"}
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(variables))
  assert count == expected_param_count(cfg)


def test_expected_param_count_by_hand():
  # The count's formula itself, on a tiny config written out term by term.
  cfg = ModelConfig(vocab_size=10, d_model=4, num_heads=2, head_dim=2, d_ff=6,
                    num_layers=2, mlp_kind="openmoe_swiglu", sparse_interval=2,
                    qk_norm=True,
                    moe=MoeConfig(num_experts=3, expert_d_ff=5, num_shared_experts=1,
                                  shared_expert_d_ff=7, shared_experts_gated=True))
  attention = 4 + 4 * 4 * 2 * 2 + 2 * 2  # norm, q k v out, q/k norm scales
  dense_mlp = 4 * 12 + 4 * 6 + 6 * 4
  dense = attention + 4 + dense_mlp
  sparse = (attention + 4 + 4 * (3 + 1) + 3 * (4 * 10 + 4 * 5 + 5 * 4)
            + (4 * 14 + 4 * 7 + 7 * 4) + 4 + dense_mlp)
  assert expected_param_count(cfg) == 2 * 10 * 4 + 4 + dense + sparse


# OpenMoE's three models as REFERENCE.md's table has them (the t5x gin files that
# trained them): (layers, d_model, heads, head_dim, MLP dim, experts, MoE layer
# indices ("every 4th" / "every 6th" layer), group size, router z-loss weight).
OPENMOE_PRESETS = {
    "models/openmoe_base_16e.gin": (12, 768, 12, 64, 2048, 16, [3, 7, 11], 4096, 1e-4),
    "models/openmoe_8b_32e.gin": (24, 2048, 24, 128, 8192, 32, [5, 11, 17, 23], 4096,
                                  1e-4),
    "models/openmoe_34b_32e.gin": (32, 3072, 24, 128, 12288, 32,
                                   list(range(3, 32, 4)), 8192, 1e-3),
}


@pytest.mark.parametrize("name", sorted(OPENMOE_PRESETS))
def test_openmoe_presets_have_the_published_settings(name):
  layers, d, heads, head_dim, d_ff, experts, moe_layers, group, z_loss = (
      OPENMOE_PRESETS[name])
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin([name], finalize=False)
  cfg = ModelConfig()
  moe = cfg.moe
  assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff) == (
      layers, d, heads, head_dim, d_ff)
  assert [i for i, s in enumerate(cfg.sparse_layers()) if s] == moe_layers
  assert (moe.num_experts, moe.expert_d_ff, cfg.vocab_size) == (experts, None, 256384)
  # REFERENCE.md, "Shared": top-2, capacity factor 1.25 train / 2.0 eval, the group
  # size, load-balance loss 0.01, the z-loss, batch-prioritized routing off, router
  # jitter 0, router init normal(0.02); the residual MLP after the experts, softmax
  # gates used as they are, first choices served first (flaxformer's order).
  assert (moe.top_k, moe.capacity_factor_train, moe.capacity_factor_eval) == (2, 1.25, 2.0)
  assert (moe.group_size, moe.lb_loss_weight, moe.z_loss_weight) == (group, 0.01, z_loss)
  assert (moe.router_init_std, moe.residual_mlp, moe.gate) == (0.02, True, "softmax")
  assert (moe.renormalize_gates, moe.routed_scaling_factor) == (False, 1.0)
  assert moe.num_shared_experts == 0 and cfg.num_dense_first == 0
  router = router_of(moe)  # the MoeLayer's router under this gin config
  assert isinstance(router, TokenChoiceRouter)
  assert (router.batch_prioritized, router.jitter_noise, router.dropless,
          router.capacity_per_choice, router.priority) == (
              False, 0.0, False, False, "choice_major")


@pytest.mark.parametrize("gin_files,objective,weight", [
    ((), "CausalLm", 1e-4),
    (("objectives/ul2.gin",), "CausalLm", 1e-4),
    (("objectives/masked_diffusion.gin",), "MaskedDiffusion", 0.0),
], ids=["causal_lm", "ul2", "masked_diffusion"])
def test_the_logits_z_loss_weight_of_each_objective(gin_files, objective, weight):
  # REFERENCE.md, "Shared": OpenMoE's logits z-loss is 1e-4 (causal and UL2 stages
  # alike); LLaDA's masked-diffusion loss is the plain weighted cross-entropy. Both
  # the class default (a run built without gin) and the gin files say so.
  from openmoe_jax import objectives  # pylint: disable=g-import-not-at-top
  assert getattr(objectives, objective)().z_loss == weight
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/quickstart.gin", *gin_files], finalize=False)
  assert gin.query_parameter(f"{objective}.z_loss") == weight
