"""OpenMoE v1's two released layouts: t5x/flaxformer names and ColossalAI's Hugging
Face port (`modeling_openmoe.py`, `convert_openmoe_ckpt.py`).

t5x stores kernels [in, out] (attention kernels flattened to [d, H*D] / [H*D, d] by
flaxformer's DenseGeneral, expert kernels [E, in, out]); the port stores torch
Linear weights [out, in], but its expert tensors untransposed ([E, d, 2f] etc.) and
its router as `gate_weight` [E, d]. Both need OpenMoE's forward: every-k MoE layers
with the extra dense MLP, OpenMoE's SwiGLU (wi_0 -> [x1 | x2]), softmax top-2
without renormalisation, unscaled attention logits, RoPE base 1e4.
"""
from typing import List, Optional

from openmoe_jax.config import ModelConfig
from openmoe_jax.convert.layout import COPY, Layout, Requirement, Rule, T, Transform
from openmoe_jax.moe.layer import router_of
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter

Q_T5X = Transform(merge="last2")  # ours [d, H, D] <-> [d, H*D]
O_T5X = Transform(merge="first2")  # ours [H, D, d] <-> [H*D, d]
Q_HF = Transform(merge="last2", transpose=True)  # <-> [H*D, d]
O_HF = Transform(merge="first2", transpose=True)  # <-> [d, H*D]


def moe_interval(cfg: ModelConfig) -> Optional[int]:
  """Returns k when layer i is MoE iff (i+1) % k == 0 (OpenMoE's only layout; the HF
  port's moe_layer_interval), else None. Explicit layer patterns count too."""
  sparse = cfg.sparse_layers()
  if True not in sparse:
    return None
  k = sparse.index(True) + 1
  return k if sparse == tuple((i + 1) % k == 0 for i in range(len(sparse))) else None


def _every_k_layout(cfg: ModelConfig) -> str:
  if moe_interval(cfg):
    return "every k-th layer MoE"
  return "".join("M" if s else "D" for s in cfg.sparse_layers())


OPENMOE_REQUIREMENTS = (
    Requirement("ModelConfig.mlp_kind", lambda c: c.mlp_kind, ("openmoe_swiglu",)),
    Requirement("ModelConfig.scale_attention_logits",
                lambda c: c.scale_attention_logits, (False,)),
    Requirement("ModelConfig.qk_norm", lambda c: c.qk_norm, (False,)),
    Requirement("ModelConfig.rope_base", lambda c: c.rope_base, (10000.0,)),
    Requirement("layer layout", _every_k_layout, ("every k-th layer MoE",)),
    Requirement("MoeConfig.router", lambda c: type(router_of(c.moe)).__name__,
                (TokenChoiceRouter.__name__,)),
    Requirement("MoeConfig.gate", lambda c: c.moe.gate, ("softmax",)),
    Requirement("MoeConfig.renormalize_gates", lambda c: c.moe.renormalize_gates,
                (False,)),
    Requirement("MoeConfig.routed_scaling_factor",
                lambda c: c.moe.routed_scaling_factor, (1.0,)),
    Requirement("MoeConfig.num_shared_experts", lambda c: c.moe.num_shared_experts,
                (0,)),
    Requirement("MoeConfig.residual_mlp", lambda c: c.moe.residual_mlp, (True,)),
    Requirement("MoeConfig.expert_d_ff", lambda c: c.expert_d_ff == c.d_ff, (True,)),
)


T5X_MLP_NAMES = (("wi_0/kernel", "wi_0"), ("wi_1/kernel", "wi_1"), ("wo/kernel", "wo"))
HF_MLP_NAMES = (("gate_proj.weight", "wi_0"), ("up_proj.weight", "wi_1"),
                ("down_proj.weight", "wo"))


def mlp_rules(prefix: str, names, ours: str, transform: Transform) -> List[Rule]:
  """Returns the rules of one dense MLP: external `prefix + name` <-> (ours, param)."""
  return [Rule(prefix + name, (ours, param), transform) for name, param in names]


def _t5x_globals(cfg: ModelConfig) -> List[Rule]:
  del cfg
  return [Rule("token_embedder/embedding", ("embed", "embedding")),
          Rule("decoder/decoder_norm/scale", ("final_norm", "scale")),
          Rule("decoder/logits_dense/kernel", ("head",))]


def _t5x_layer(cfg: ModelConfig, i: int, sparse: bool) -> List[Rule]:
  del cfg
  p = f"decoder/layers_{i}/"
  rules = [Rule(p + "pre_self_attention_layer_norm/scale", ("pre_attention_norm", "scale"))]
  for name in ("query", "key", "value"):
    rules.append(Rule(p + f"self_attention/{name}/kernel", ("attention", name), Q_T5X))
  rules.append(Rule(p + "self_attention/out/kernel", ("attention", "out"), O_T5X))
  if not sparse:
    return rules + [Rule(p + "pre_mlp_layer_norm/scale", ("pre_mlp_norm", "scale"))] + (
        mlp_rules(p + "mlp/", T5X_MLP_NAMES, "mlp", COPY))
  rules += [Rule(p + "pre_mlp_layer_norm/scale", ("pre_moe_norm", "scale")),
            Rule(p + "mlp/router/router_weights/w/kernel", ("moe", "router", "w"))]
  rules += [Rule(p + f"mlp/expert/{n}/kernel", ("moe", "experts", n))
            for n in ("wi_0", "wi_1", "wo")]
  rules.append(Rule(p + "pre_extra_mlp_layer_norm/scale", ("pre_mlp_norm", "scale")))
  return rules + mlp_rules(p + "extra_mlp/", T5X_MLP_NAMES, "mlp", COPY)


def _hf_globals(cfg: ModelConfig) -> List[Rule]:
  del cfg
  return [Rule("model.embed_tokens.weight", ("embed", "embedding")),
          Rule("model.norm.weight", ("final_norm", "scale")),
          Rule("lm_head.weight", ("head",), T)]


def _hf_layer(cfg: ModelConfig, i: int, sparse: bool) -> List[Rule]:
  del cfg
  p = f"model.layers.{i}."
  rules = [Rule(p + "input_layernorm.weight", ("pre_attention_norm", "scale"))]
  for hf, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
    rules.append(Rule(p + f"self_attn.{hf}.weight", ("attention", ours), Q_HF))
  rules.append(Rule(p + "self_attn.o_proj.weight", ("attention", "out"), O_HF))
  if not sparse:
    return rules + [Rule(p + "post_attention_layernorm.weight", ("pre_mlp_norm", "scale"))
                    ] + mlp_rules(p + "mlp.", HF_MLP_NAMES, "mlp", T)
  rules += [Rule(p + "post_attention_layernorm.weight", ("pre_moe_norm", "scale")),
            Rule(p + "mlp.gate_weight", ("moe", "router", "w"), T),
            Rule(p + "mlp.experts.wi_gate", ("moe", "experts", "wi_0")),
            Rule(p + "mlp.experts.wi_up", ("moe", "experts", "wi_1")),
            Rule(p + "mlp.experts.wo", ("moe", "experts", "wo")),
            Rule(p + "pre_extra_mlp_layernorm.weight", ("pre_mlp_norm", "scale"))]
  return rules + mlp_rules(p + "extra_mlp.", HF_MLP_NAMES, "mlp", T)


T5X_OPENMOE = Layout("t5x", _t5x_globals, _t5x_layer, OPENMOE_REQUIREMENTS)
HF_OPENMOE = Layout("openmoe", _hf_globals, _hf_layer, OPENMOE_REQUIREMENTS)


def openmoe_hf_config(cfg: ModelConfig) -> dict:
  """Returns the config.json of ColossalAI's OpenMoE port for `cfg` (its field names,
  as in openmoe_{base,8b,34b}_config.json)."""
  moe = cfg.moe
  return {
      "architectures": ["OpenMoeForCausalLM"],
      "auto_map": {"AutoModelForCausalLM": "modeling_openmoe.OpenMoeForCausalLM"},
      "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
      "head_dim": cfg.head_dim, "hidden_act": "swiglu", "mlp_gated": True,
      "rms_norm_eps": cfg.norm_eps, "layer_norm_epsilon": cfg.norm_eps,
      "rope_theta": cfg.rope_base, "rope_scaling": None, "attention_bias": False,
      "tie_word_embeddings": False, "pretraining_tp": 1, "dropout_rate": 0.0,
      "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
      "max_position_embeddings": 2048, "initializer_range": 0.02,
      "num_experts": moe.num_experts, "moe_layer_interval": moe_interval(cfg),
      "router_topk": moe.top_k,
      "router_capacity_factor_train": moe.capacity_factor_train,
      "router_capacity_factor_eval": moe.capacity_factor_eval,
      "router_min_capacity": moe.min_capacity, "router_noisy_policy": None,
      "router_drop_tks": not getattr(router_of(moe), "dropless", False),
      "router_aux_loss_factor": moe.lb_loss_weight,
      "router_z_loss_factor": moe.z_loss_weight,
      "torch_dtype": "float32", "use_cache": True,
  }
