"""transformers-native layouts: Mixtral, Qwen3-MoE and GLM-4-MoE.

Each maps our parameters exactly onto a transformers architecture (checked against
transformers 5.24's modeling files), so `{Mixtral,Qwen3Moe,Glm4Moe}ForCausalLM.
from_pretrained` on the exported folder computes our function:

- Mixtral: every layer MoE, softmax router, top-k gates renormalised, standard
  SwiGLU experts (w1 gate, w3 up, w2 down), no dense MLP beside the experts, no
  shared experts, attention logits scaled by 1/sqrt(head_dim), no QK-norm.
- Qwen3-MoE: any dense/MoE pattern (`decoder_sparse_step` 1, dense layers listed in
  `mlp_only_layers`), per-head q/k RMSNorm before RoPE (our `qk_norm`), top-k
  renormalised or not (`norm_topk_prob`), dense MLP width `intermediate_size`,
  expert width `moe_intermediate_size`.
- GLM-4-MoE: sigmoid gates, one always-on shared expert, the first k layers dense
  (details above GLM4_MOE below).

All use Llama's attention (q/k/v/o_proj, torch [out, in]), half-split RoPE at
`rope_theta`, RMSNorm at `rms_norm_eps`, untied `lm_head`, num_key_value_heads =
num_heads. Experts are written one tensor per expert, as `save_pretrained` writes
them (see hf_experts.py); import also takes transformers' fused in-memory names.

Routing capacity is not part of the weights: transformers' MoE blocks never drop
tokens, so their logits equal ours when our router is dropless (or its capacity
covers every choice). A model trained with capacity exports unchanged (as OpenMoE's
own layouts do); it then runs dropless in transformers, as in our evaluation with
ample capacity. Router jitter is training-only and written as 0.

Entry points: `export_hf_tensors` / `import_hf_tensors` (any layout, on-disk names),
`*_hf_config` (config.json), `all_layouts()` (the `others` of check_supported).
"""
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np

from openmoe_jax.config import ModelConfig
from openmoe_jax.convert import hf_experts
from openmoe_jax.convert.hf_experts import STACK
from openmoe_jax.convert.layout import (ConversionError, Layout, Requirement, Rule, T,
                                        Transform, check_supported, export_tensors,
                                        import_tensors)
from openmoe_jax.convert.openmoe import (HF_MLP_NAMES, HF_OPENMOE, O_HF, Q_HF,
                                         T5X_OPENMOE, mlp_rules)
from openmoe_jax.moe.layer import router_of
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter


def layer_pattern(cfg: ModelConfig) -> str:
  """Returns the layers as a string of "D" (dense) and "M" (MoE)."""
  return "".join("M" if s else "D" for s in cfg.sparse_layers())


def _all_moe(cfg: ModelConfig) -> str:
  pattern = layer_pattern(cfg)
  return "all MoE" if set(pattern) == {"M"} else pattern


def _residual_mlp(cfg: ModelConfig) -> bool:
  """OpenMoE's extra MLP exists only beside MoE layers."""
  return cfg.moe.residual_mlp and any(cfg.sparse_layers())


# One option name per setting across layouts: check_supported lists as takers the
# layouts with no unmet requirement of the same name.
LAYER_LAYOUT = "layer layout"
SWIGLU = Requirement("ModelConfig.mlp_kind", lambda c: c.mlp_kind, ("swiglu",))
SCALED = Requirement("ModelConfig.scale_attention_logits",
                     lambda c: c.scale_attention_logits, (True,))
TOKEN_CHOICE = Requirement("MoeConfig.router", lambda c: type(router_of(c.moe)).__name__,
                           (TokenChoiceRouter.__name__,))
NO_RESIDUAL_MLP = Requirement("MoeConfig.residual_mlp", _residual_mlp, (False,))
UNSCALED_GATES = Requirement("MoeConfig.routed_scaling_factor",
                             lambda c: c.moe.routed_scaling_factor, (1.0,))
NO_SHARED = Requirement("MoeConfig.num_shared_experts",
                        lambda c: c.moe.num_shared_experts, (0,))
SOFTMAX = Requirement("MoeConfig.gate", lambda c: c.moe.gate, ("softmax",))

MIXTRAL_REQUIREMENTS = (
    SWIGLU, SCALED,
    Requirement("ModelConfig.qk_norm", lambda c: c.qk_norm, (False,)),
    Requirement(LAYER_LAYOUT, _all_moe, ("all MoE",)),
    TOKEN_CHOICE, SOFTMAX,
    Requirement("MoeConfig.renormalize_gates", lambda c: c.moe.renormalize_gates,
                (True,)),
    UNSCALED_GATES, NO_SHARED, NO_RESIDUAL_MLP,
)
QWEN3_MOE_REQUIREMENTS = (
    SWIGLU, SCALED,
    Requirement("ModelConfig.qk_norm", lambda c: c.qk_norm, (True,)),
    TOKEN_CHOICE, SOFTMAX, UNSCALED_GATES, NO_SHARED, NO_RESIDUAL_MLP,
)


def llama_globals(cfg: ModelConfig) -> List[Rule]:
  """Returns the embedding, final norm and untied head rules ([V, d] torch head)."""
  del cfg
  return [Rule("model.embed_tokens.weight", ("embed", "embedding")),
          Rule("model.norm.weight", ("final_norm", "scale")),
          Rule("lm_head.weight", ("head",), T)]


def attention_rules(p: str, qk_norm: bool) -> List[Rule]:
  """Returns Llama-style attention rules under prefix `p` (+ Qwen3's q/k_norm)."""
  rules = [Rule(p + "input_layernorm.weight", ("pre_attention_norm", "scale"))]
  for hf, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
    rules.append(Rule(p + f"self_attn.{hf}.weight", ("attention", ours), Q_HF))
  rules.append(Rule(p + "self_attn.o_proj.weight", ("attention", "out"), O_HF))
  if qk_norm:
    rules += [Rule(p + "self_attn.q_norm.weight", ("attention", "query_norm", "scale")),
              Rule(p + "self_attn.k_norm.weight", ("attention", "key_norm", "scale"))]
  return rules


def dense_rules(p: str) -> List[Rule]:
  """Returns a dense layer's MLP rules (gate/up/down_proj) and its norm."""
  return [Rule(p + "post_attention_layernorm.weight", ("pre_mlp_norm", "scale"))
          ] + mlp_rules(p + "mlp.", HF_MLP_NAMES, "mlp", T)


def moe_rules(p: str, names: Tuple[str, str, str]) -> List[Rule]:
  """Returns an MoE layer's router and expert-stack rules under `p` (e.g.
  "model.layers.3.mlp."); `names` are the experts' (gate, up, down) Linear names."""
  rules = [Rule(p + "gate.weight", ("moe", "router", "w"), T)]
  for hf, ours in zip(names, ("wi_0", "wi_1", "wo")):
    rules.append(Rule(p + f"experts.{STACK}.{hf}.weight", ("moe", "experts", ours), T))
  return rules


MIXTRAL_EXPERTS = ("w1", "w3", "w2")
QWEN_EXPERTS = ("gate_proj", "up_proj", "down_proj")


def _mixtral_layer(cfg: ModelConfig, i: int, sparse: bool) -> List[Rule]:
  del sparse  # every layer is MoE (a requirement)
  p = f"model.layers.{i}."
  return attention_rules(p, qk_norm=False) + [
      Rule(p + "post_attention_layernorm.weight", ("pre_moe_norm", "scale"))
  ] + moe_rules(p + "block_sparse_moe.", MIXTRAL_EXPERTS)


def _qwen3_moe_layer(cfg: ModelConfig, i: int, sparse: bool) -> List[Rule]:
  p = f"model.layers.{i}."
  rules = attention_rules(p, cfg.qk_norm)
  if not sparse:
    return rules + dense_rules(p)
  return rules + [Rule(p + "post_attention_layernorm.weight", ("pre_moe_norm", "scale"))
                  ] + moe_rules(p + "mlp.", QWEN_EXPERTS)


MIXTRAL = Layout("mixtral", llama_globals, _mixtral_layer, MIXTRAL_REQUIREMENTS)
QWEN3_MOE = Layout("qwen3_moe", llama_globals, _qwen3_moe_layer, QWEN3_MOE_REQUIREMENTS)


def llama_config_fields(cfg: ModelConfig) -> dict:
  """Returns the config.json fields every Llama-style layout shares."""
  if cfg.vocab_size is None:
    raise ConversionError("ModelConfig.vocab_size is unset: bind it in gin (the "
                          "vocabulary's size) before writing a Hugging Face config")
  return {
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_heads, "head_dim": cfg.head_dim,
      "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_base,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
      "attention_bias": False, "attention_dropout": 0.0,
      "tie_word_embeddings": False, "sliding_window": None,
      # seqio ids of our vocabularies; OpenMoE starts inputs with 0 as BOS.
      "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
      "max_position_embeddings": 4096, "initializer_range": 0.02,
      "router_aux_loss_coef": cfg.moe.lb_loss_weight, "output_router_logits": False,
      "torch_dtype": "float32", "use_cache": True,
  }


def mixtral_hf_config(cfg: ModelConfig) -> dict:
  """Returns the config.json of `MixtralForCausalLM` for `cfg` (which must meet
  MIXTRAL's requirements: raises ConversionError otherwise)."""
  check_supported(cfg, MIXTRAL, all_layouts())
  return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
          **llama_config_fields(cfg),
          "intermediate_size": cfg.expert_d_ff,
          "num_local_experts": cfg.moe.num_experts,
          "num_experts_per_tok": cfg.moe.top_k, "router_jitter_noise": 0.0}


def qwen3_moe_hf_config(cfg: ModelConfig) -> dict:
  """Returns the config.json of `Qwen3MoeForCausalLM` for `cfg` (which must meet
  QWEN3_MOE's requirements: raises ConversionError otherwise)."""
  check_supported(cfg, QWEN3_MOE, all_layouts())
  return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
          **llama_config_fields(cfg),
          "intermediate_size": cfg.d_ff, "moe_intermediate_size": cfg.expert_d_ff,
          "num_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k,
          "norm_topk_prob": cfg.moe.renormalize_gates, "decoder_sparse_step": 1,
          "mlp_only_layers": [i for i, s in enumerate(cfg.sparse_layers()) if not s],
          "use_sliding_window": False, "max_window_layers": cfg.num_layers}


# GLM-4-MoE (`Glm4MoeForCausalLM`): DeepSeek-V3-style MoE with Llama attention.
# Sigmoid scores, top-k (n_group = topk_group = 1: no group restriction), gates
# optionally renormalised, times routed_scaling_factor; one always-on shared MLP of
# width n_shared_experts x moe_intermediate_size (ours: one shared expert of a
# multiple of the expert width); the first `first_k_dense_replace` layers dense;
# per-head q/k RMSNorm before RoPE when use_qk_norm; full rotary
# (partial_rotary_factor 1). Its expert-selection bias `e_score_correction_bias` has
# no counterpart here: export writes zeros, import refuses anything else.


def _first_k_dense(cfg: ModelConfig) -> str:
  pattern = layer_pattern(cfg)
  return "first-k dense" if "MD" not in pattern else pattern


def _one_shared_expert(cfg: ModelConfig):
  """Returns 1 when the shared experts are one ungated MLP of a multiple of the
  expert width (GLM's n_shared_experts x moe_intermediate_size), else what differs."""
  moe = cfg.moe
  width = moe.shared_expert_d_ff or cfg.expert_d_ff
  if moe.num_shared_experts != 1:
    return moe.num_shared_experts
  if moe.shared_experts_gated:
    return "1 with shared_experts_gated"
  if width % cfg.expert_d_ff:
    return f"1 with shared_expert_d_ff {width}, not a multiple of expert_d_ff"
  return 1


GLM4_MOE_REQUIREMENTS = (
    SWIGLU, SCALED,
    Requirement(LAYER_LAYOUT, _first_k_dense, ("first-k dense",)),
    TOKEN_CHOICE, Requirement("MoeConfig.gate", lambda c: c.moe.gate, ("sigmoid",)),
    # Named like the other layouts' requirement, which refuses any shared expert.
    Requirement("MoeConfig.num_shared_experts", _one_shared_expert, (1,)),
    NO_RESIDUAL_MLP,
)
SHARED = Transform(merge="first2", transpose=True)  # ours [1, d, f] <-> [f, d]
SCORE_BIAS = "gate.e_score_correction_bias"


def _glm4_moe_layer(cfg: ModelConfig, i: int, sparse: bool) -> List[Rule]:
  p = f"model.layers.{i}."
  rules = attention_rules(p, cfg.qk_norm)
  if not sparse:
    return rules + dense_rules(p)
  return rules + [Rule(p + "post_attention_layernorm.weight", ("pre_moe_norm", "scale"))
                  ] + moe_rules(p + "mlp.", QWEN_EXPERTS) + [
      Rule(p + f"mlp.shared_experts.{hf}.weight", ("moe", "shared_experts", ours), SHARED)
      for hf, ours in zip(QWEN_EXPERTS, ("wi_0", "wi_1", "wo"))]


GLM4_MOE = Layout("glm4_moe", llama_globals, _glm4_moe_layer, GLM4_MOE_REQUIREMENTS)


def glm4_moe_hf_config(cfg: ModelConfig) -> dict:
  """Returns the config.json of `Glm4MoeForCausalLM` for `cfg` (which must meet
  GLM4_MOE's requirements: raises ConversionError otherwise)."""
  check_supported(cfg, GLM4_MOE, all_layouts())
  moe = cfg.moe
  fields = llama_config_fields(cfg)
  fields["rope_parameters"]["partial_rotary_factor"] = 1.0
  return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **fields,
          "partial_rotary_factor": 1.0,
          "intermediate_size": cfg.d_ff, "moe_intermediate_size": cfg.expert_d_ff,
          "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
          "n_shared_experts": (moe.shared_expert_d_ff or cfg.expert_d_ff
                               ) // cfg.expert_d_ff,
          "first_k_dense_replace": layer_pattern(cfg).count("D"),
          "n_group": 1, "topk_group": 1, "norm_topk_prob": moe.renormalize_gates,
          "routed_scaling_factor": moe.routed_scaling_factor,
          "use_qk_norm": cfg.qk_norm, "num_nextn_predict_layers": 0}


def _score_biases(cfg: ModelConfig) -> Iterator[Tuple[str, np.ndarray]]:
  for i, sparse in enumerate(cfg.sparse_layers()):
    if sparse:
      yield (f"model.layers.{i}.mlp.{SCORE_BIAS}",
             np.zeros((cfg.moe.num_experts,), np.float32))


def _drop_zero_biases(read, names: Sequence[str]) -> List[str]:
  """Returns `names` without GLM's selection biases; raises ConversionError if one
  is not all zeros."""
  for name in names:
    if name.endswith(SCORE_BIAS) and np.any(np.asarray(read(name))):
      raise ConversionError(
          f"the checkpoint's {name!r} is not zero: GLM-4-MoE's expert-selection bias "
          "(aux-loss-free balancing) has no counterpart in openmoe_jax")
  return [n for n in names if not n.endswith(SCORE_BIAS)]


def all_layouts() -> Tuple[Layout, ...]:
  """Returns every layout openmoe-convert knows (the `others` of check_supported)."""
  return (T5X_OPENMOE, HF_OPENMOE, MIXTRAL, QWEN3_MOE, GLM4_MOE)


# (MoE module, expert gate, up, down names) of the native layouts.
_EXPERT_NAMES = {MIXTRAL.name: ("block_sparse_moe",) + MIXTRAL_EXPERTS,
                 QWEN3_MOE.name: ("mlp",) + QWEN_EXPERTS,
                 GLM4_MOE.name: ("mlp",) + QWEN_EXPERTS}


def export_hf_tensors(params: Dict, cfg: ModelConfig, layout: Layout
                      ) -> Iterator[Tuple[str, np.ndarray]]:
  """Yields (name, numpy array) for every tensor of `layout` under the names
  `save_pretrained` writes (experts one tensor each), one tensor at a time.

  Any layout (OpenMoE's have no expert stacks). Raises ConversionError naming the
  first option `layout` cannot express and the layouts that can.
  """
  check_supported(cfg, layout, all_layouts())
  yield from hf_experts.split_stacks(export_tensors(params, cfg, layout))
  if layout.name == GLM4_MOE.name:
    yield from _score_biases(cfg)


def import_hf_tensors(read, names: Sequence[str], cfg: ModelConfig, layout: Layout,
                      shapes: Dict, dtype=np.float32, progress=lambda _: None
                      ) -> Dict:
  """Returns our params tree (numpy, `dtype`) from a transformers checkpoint of
  `layout`: per-expert tensors as `save_pretrained` writes them, or transformers'
  fused in-memory names. `read`, `names`, `shapes` as in layout.import_tensors.
  Raises ConversionError (one line) on anything that does not fit."""
  check_supported(cfg, layout, all_layouts())
  if layout.name in _EXPERT_NAMES:
    read, names = hf_experts.fused_reader(read, names, *_EXPERT_NAMES[layout.name])
  read, names = hf_experts.stack_reader(read, names)
  if layout.name == GLM4_MOE.name:
    names = _drop_zero_biases(read, names)
  return import_tensors(read, names, cfg, layout, shapes, dtype, progress)
