"""Model configuration: small frozen dataclasses, each bindable from gin.

Plain data: this module imports nothing of the package. A layer reads only the
config it needs (`MoeConfig` for the MoE block, `ModelConfig` for the decoder), never
a global one, and checks the values it alone understands (the MLP kind in
layers/mlp.py, the gate kind in moe/gates.py) when it is built.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, List, Optional, Tuple

import gin

ATTENTION_KINDS = ("causal", "prefix", "bidirectional")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
DTYPES = ("float32", "bfloat16")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """Sparse (ST-MoE) block settings; defaults follow OpenMoE v1.

  `router` is the routing policy chosen in gin (`@TokenChoiceRouter()` or
  `@ExpertChoiceRouter()`; None, the default, means `TokenChoiceRouter()`, resolved
  by `MoeLayer`), called with the shared fields here as arguments. `gate` is
  "softmax" or "sigmoid" over the router logits (checked by moe/gates.py);
  `renormalize_gates` renormalises the selected routed gates per token;
  `routed_scaling_factor` multiplies every routed gate. Shared experts
  (`num_shared_experts` MLPs of `shared_expert_d_ff`, None: the expert size) are
  always-on and added with weight 1, or with `shared_experts_gated` weighted by their
  own router rows (`router/w_shared`), normalised jointly with the routed logits by
  the gate function (not renormalised, not scaled). `dispatcher` is the dispatch
  engine chosen in gin (moe/dispatch/): `@AutoDispatcher()` (None, the default, means
  it: Pallas ragged on TPU, einsum for small E x C elsewhere, else sort),
  `@EinsumDispatcher()`, `@SortDispatcher()` (same drops, no E x C one-hots) or
  `@RaggedDispatcher()` (grouped matmul; dropless with
  `TokenChoiceRouter.dropless = True`).
  """

  num_experts: int = 16
  top_k: int = 2
  expert_d_ff: Optional[int] = None  # None: same as the dense MLP's d_ff
  group_size: int = 4096
  capacity_factor_train: float = 1.25
  capacity_factor_eval: float = 2.0
  min_capacity: int = 4
  renormalize_gates: bool = False
  residual_mlp: bool = True  # OpenMoE's extra dense MLP after the experts
  lb_loss_weight: float = 0.01
  z_loss_weight: float = 1e-4
  router_init_std: float = 0.02
  router: Any = None  # None: TokenChoiceRouter()
  gate: str = "softmax"
  routed_scaling_factor: float = 1.0
  tokenwise_lb_loss_weight: float = 0.0  # expert choice's token-wise LB loss
  num_shared_experts: int = 0
  shared_expert_d_ff: Optional[int] = None
  shared_experts_gated: bool = False
  dispatcher: Any = None  # None: AutoDispatcher()

  def __post_init__(self):
    _check_types(self)
    for name in ("capacity_factor_train", "capacity_factor_eval"):
      if getattr(self, name) <= 0:
        raise ValueError(f"MoeConfig.{name}={getattr(self, name)} must be > 0 (1.0: "
                         "each expert takes its even share of the group's tokens)")
    if self.num_shared_experts < 0:
      raise ValueError("MoeConfig.num_shared_experts must be >= 0")
    if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
      raise ValueError(
          f"MoeConfig: need 1 <= top_k ({self.top_k}) <= num_experts ({self.num_experts})")
    if self.group_size < 1 or self.min_capacity < 0:
      raise ValueError("MoeConfig: group_size must be >= 1 and min_capacity >= 0")

  def replace(self, **changes) -> "MoeConfig":
    """Returns a copy with `changes` applied."""
    return dataclasses.replace(self, **changes)

  def capacity_factor(self, train: bool) -> float:
    """Returns the capacity factor used in training or in evaluation."""
    return self.capacity_factor_train if train else self.capacity_factor_eval


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer settings.

  Layer i is sparse iff `sparse_interval > 0`, `i >= num_dense_first` and
  `i % sparse_interval == sparse_interval - 1` (OpenMoE's MIXED layout), unless
  `layer_pattern` lists every layer explicitly: one letter per layer, "D" dense and
  "M" MoE (e.g. "DDMMMM": two dense layers, then MoE); it then overrides
  `sparse_interval` and `num_dense_first`.
  """

  vocab_size: Optional[int] = None  # None: taken from the task's vocabulary
  d_model: int = 256
  num_heads: int = 4
  head_dim: int = 64
  d_ff: int = 1024
  num_layers: int = 4
  mlp_kind: str = "openmoe_swiglu"  # layers/mlp.py MLP_KINDS (checked there)
  sparse_interval: int = 2
  num_dense_first: int = 0
  layer_pattern: Optional[str] = None
  moe: MoeConfig = dataclasses.field(default_factory=MoeConfig)
  dtype: str = "float32"  # activations; params and router math stay float32
  remat_policy: str = "none"
  scan_layers: bool = True
  rope_base: float = 10000.0
  norm_eps: float = 1e-6
  emb_init_std: float = 1.0
  qk_norm: bool = False  # RMSNorm on each head's queries and keys (OpenMoE 2)
  # False: attention logits are not scaled by 1/sqrt(head_dim) (T5 / flaxformer /
  # OpenMoE v1, which fold the factor into the query initialisation instead).
  scale_attention_logits: bool = True
  # The attention implementation (layers/attention_impls.py), chosen in gin:
  # @AutoAttention() (None, the default, means it: splash on TPU, jax's
  # dot_product_attention elsewhere, cuDNN on GPU), @PlainAttention(),
  # @XlaDotProductAttention(), @SplashAttention().
  attention_impl: Any = None

  def __post_init__(self):
    _check_types(self)
    for name in ("d_model", "num_heads", "head_dim", "d_ff"):
      if getattr(self, name) < 1:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be >= 1")
    if self.vocab_size is not None and self.vocab_size < 1:
      raise ValueError(f"ModelConfig.vocab_size={self.vocab_size} must be >= 1 (or "
                       "None: the task vocabulary's size)")
    _check_choice("remat_policy", self.remat_policy, REMAT_POLICIES)
    _check_choice("dtype", self.dtype, DTYPES)
    if self.num_layers < 1 or self.sparse_interval < 0 or self.num_dense_first < 0:
      raise ValueError("ModelConfig: num_layers >= 1, sparse_interval >= 0, "
                       "num_dense_first >= 0 required")
    if self.layer_pattern is not None and (
        len(self.layer_pattern) != self.num_layers
        or set(self.layer_pattern) - set("DM")):
      raise ValueError(f"ModelConfig.layer_pattern={self.layer_pattern!r} needs one "
                       f"letter D (dense) or M (MoE) per layer ({self.num_layers})")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")

  def sparse_layers(self) -> Tuple[bool, ...]:
    """Returns, per layer, whether it is an MoE layer."""
    if self.layer_pattern is not None:
      return tuple(c == "M" for c in self.layer_pattern)
    k = self.sparse_interval
    return tuple(
        bool(k) and i >= self.num_dense_first and i % k == k - 1
        for i in range(self.num_layers))

  def moe_layer_numbers(self) -> List[int]:
    """Returns the layer numbers (0-based) of the MoE layers, in order: the numbers
    metrics (`moe/layer_<n>/...`), the routing analysis and summaries name them by."""
    return [i for i, sparse in enumerate(self.sparse_layers()) if sparse]

  @property
  def expert_d_ff(self) -> int:
    """Returns the hidden size of one expert."""
    return self.moe.expert_d_ff or self.d_ff

  def replace(self, **changes) -> "ModelConfig":
    """Returns a copy with `changes` applied."""
    return dataclasses.replace(self, **changes)


# Field annotations (strings: `from __future__ import annotations`) -> accepted types.
_FIELD_TYPES = {"int": numbers.Integral, "float": numbers.Real, "bool": (bool,),
                "str": (str,)}


def _check_types(config) -> None:
  """Raises ValueError naming the first field of the dataclass `config` whose value
  does not have its annotated type (int, float, bool, str, Optional of these)."""
  for field in dataclasses.fields(config):
    annotation, optional = field.type, False
    if annotation.startswith("Optional[") and annotation.endswith("]"):
      annotation, optional = annotation[len("Optional["):-1], True
    types = _FIELD_TYPES.get(annotation)
    value = getattr(config, field.name)
    if types is None or (optional and value is None):
      continue
    if not isinstance(value, types) or (annotation != "bool" and isinstance(value, bool)):
      raise ValueError(f"{type(config).__name__}.{field.name}={value!r} must be "
                       f"{'an' if annotation == 'int' else 'a'} {annotation}"
                       + (" or None" if optional else ""))


def _check_choice(name, value, choices):
  if value not in choices:
    raise ValueError(f"ModelConfig.{name}={value!r}; choose one of {choices}")


VOCAB_MULTIPLE = 128  # embedding rows are padded so the vocab axis shards evenly


def build_model_config(model_config: ModelConfig | None, vocab_size: int) -> ModelConfig:
  """Returns `model_config` (default: gin's ModelConfig()) with vocab_size filled in:
  the task vocabulary's size rounded up to VOCAB_MULTIPLE when unset."""
  cfg = model_config or ModelConfig()
  if cfg.vocab_size is None:
    cfg = cfg.replace(vocab_size=-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
  elif cfg.vocab_size < vocab_size:
    raise ValueError(f"ModelConfig.vocab_size={cfg.vocab_size} is smaller than the "
                     f"task vocabulary ({vocab_size})")
  return cfg
