"""Attention implementations: softmax(q k^T * scale + mask) v, chosen in gin.

Each is called as `impl(q_bthk, k_bthk, v_bthk, mask, scale)` with an
`AttentionMask` (layers/attention_mask.py) and returns out_bthk in v's dtype; the
logits and the softmax are float32 in all of them.

- `PlainAttention`: einsum + softmax over the dense [b, 1, t, t] mask (T^2 logits
  in memory); the reference, and the decoding (KV cache) path.
- `XlaDotProductAttention`: `jax.nn.dot_product_attention`; "cudnn" (fused flash
  attention) on GPU for bf16/fp16 and head_dim <= 128, else "xla". Causal masks
  go as `is_causal`; packing and prefix masks as a dense bool mask.
- `SplashAttention`: the Pallas TPU splash attention kernel shipped with jax
  (blockwise, no T^2 logits), causal or bidirectional with packed segment ids;
  Pallas interpret mode off TPU (tests). Prefix-LM masks and explicit masks
  are not expressible as splash masks: those calls go to `fallback` (logged).
- `AutoAttention` (the default): splash on TPU when the shapes allow it,
  `XlaDotProductAttention()` elsewhere.

Gin: `ModelConfig.attention_impl = @SplashAttention()` (None means AutoAttention()).
"""
import dataclasses
import logging
import math
from typing import Any, Optional

import gin
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import \
    splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import \
    splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec

from openmoe_jax import partitioning
from openmoe_jax.kernels import target
from openmoe_jax.layers.attention_mask import AttentionMask

SPLASH_MULTIPLE = 128  # splash's blocks are multiples of the 128 TPU lanes


@gin.configurable
@dataclasses.dataclass(frozen=True)
class PlainAttention:
  """Einsum + float32 softmax over the dense mask; probabilities cast to v's dtype.

  On the CPU, self-attention (as many keys as queries) moves the heads ahead of
  the tokens first ([b, h, t, k] copies of q, k and v) so both products batch over
  (b, h) with contiguous [t, k] operands: on a 2-core AVX-512 CPU, [8, 256] tokens
  x 4 heads of 64, causal, fwd+bwd went from 20.0-20.4 to 15.6-16.4 ms, and the
  quickstart's train step 1.9-2.4% faster (median of 10 and of 16 paired steps, two
  runs). Decoding (one query against a KV cache) keeps the einsums on [b, t, h, k],
  which copy no cache, and so do TPU and GPU programs, where XLA assigns the
  layouts itself (nothing measured there says the copies help).
  `heads_first`: None (the default) is the above; True or False forces it for
  self-attention on any backend (gin `PlainAttention.heads_first = False`, e.g. to
  time both with benchmarks/train_step.py)."""

  heads_first: Optional[bool] = None

  def __call__(self, q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array,
               mask: AttentionMask, scale: float) -> jax.Array:
    """Returns the attention output [b, t, h, k] in v's dtype."""
    b, t = q_bthk.shape[:2]
    heads_first = (cpu_target() if self.heads_first is None else self.heads_first
                   ) and k_bthk.shape[1] == t
    if heads_first:
      q_bhqk, k_bhsk, v_bhsk = (jnp.swapaxes(a, 1, 2) for a in (q_bthk, k_bthk, v_bthk))
      scores_bhqs = jnp.einsum("bhqk,bhsk->bhqs", q_bhqk, k_bhsk,
                               preferred_element_type=jnp.float32)
    else:
      scores_bhqs = jnp.einsum("bqhk,bshk->bhqs", q_bthk, k_bthk,
                               preferred_element_type=jnp.float32)
    if scale != 1.0:
      scores_bhqs = scores_bhqs * scale
    scores_bhqs = jnp.where(mask.dense(b, t), scores_bhqs, jnp.finfo(jnp.float32).min)
    probs_bhqs = jax.nn.softmax(scores_bhqs, axis=-1).astype(v_bthk.dtype)
    if heads_first:
      return jnp.swapaxes(jnp.einsum("bhqs,bhsk->bhqk", probs_bhqs, v_bhsk), 1, 2)
    return jnp.einsum("bhqs,bshk->bqhk", probs_bhqs, v_bthk)


def cpu_target() -> bool:
  """Returns whether programs are built for the CPU (not for a TPU compile target,
  which the planner sets on a CPU host)."""
  return not target.on_tpu() and jax.default_backend() == "cpu"


def cudnn_supported(q_bthk: jax.Array) -> bool:
  """Returns whether cuDNN flash attention serves these queries: a GPU target,
  bf16 or fp16, head_dim a multiple of 8 up to 128."""
  head_dim = q_bthk.shape[-1]
  return (not target.on_tpu() and jax.default_backend() == "gpu"
          and q_bthk.dtype in (jnp.bfloat16, jnp.float16)
          and head_dim <= 128 and head_dim % 8 == 0)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class XlaDotProductAttention:
  """`jax.nn.dot_product_attention` with `implementation` ("xla", "cudnn", or None:
  "cudnn" where `cudnn_supported`, else "xla")."""

  implementation: Optional[str] = None

  def __post_init__(self):
    if self.implementation not in (None, "xla", "cudnn"):
      raise ValueError(f"XlaDotProductAttention.implementation="
                       f"{self.implementation!r}; choose None, 'xla' or 'cudnn'")

  def __call__(self, q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array,
               mask: AttentionMask, scale: float) -> jax.Array:
    """Returns the attention output [b, t, h, k] in v's dtype."""
    b, t = q_bthk.shape[:2]
    if mask.explicit_b1tt is not None or mask.kind == "prefix":
      dense_b1tt, is_causal = mask.dense(b, t), False
    else:
      dense_b1tt, is_causal = mask.same_segment_b1tt(), mask.kind == "causal"
    call = lambda implementation: jax.nn.dot_product_attention(
        q_bthk, k_bthk, v_bthk, mask=dense_b1tt, scale=scale, is_causal=is_causal,
        implementation=implementation)
    if self.implementation is not None:
      return call(self.implementation)
    if cudnn_supported(q_bthk):
      try:
        return call("cudnn")
      except (NotImplementedError, RuntimeError, ValueError) as e:  # cuDNN version, shape
        logging.warning("cuDNN attention unavailable (%s); using XLA's", e)
    return call("xla")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SplashAttention:
  """The Pallas splash attention kernel (jax.experimental.pallas.ops.tpu).

  Causal or bidirectional masks, with packed segments as splash segment ids, over
  a multiple of 128 tokens (bf16 inputs upcast to float32 on TPU v3, whose Mosaic
  has no bf16 matmuls). `block_size`: the kernel's q and kv blocks (the gcd with
  the length). `interpret`: None compiles the kernel on TPU
  and runs Pallas interpret mode elsewhere (slow; for tests). Prefix-LM and
  explicit masks and other lengths (model init traces short dummy inputs) go to
  `fallback` (None: XlaDotProductAttention("xla")), logged. On a
  multi-device mesh the kernel runs under shard_map, the batch split like the
  activations and the heads over the tensor axis (Mosaic calls cannot be
  partitioned by GSPMD).
  """

  block_size: int = 512
  interpret: Optional[bool] = None
  fallback: Any = None

  def __post_init__(self):
    if self.block_size < 1 or self.block_size % SPLASH_MULTIPLE:
      raise ValueError(f"SplashAttention.block_size={self.block_size} must be a "
                       f"positive multiple of {SPLASH_MULTIPLE}")

  def handles(self, mask: AttentionMask, q_bthk: jax.Array, k_bthk: jax.Array) -> bool:
    """Returns whether the kernel serves this call (else `fallback` does):
    self-attention over a multiple of 128 tokens, a causal or bidirectional mask."""
    t = q_bthk.shape[1]
    return (mask.explicit_b1tt is None and mask.kind in ("causal", "bidirectional")
            and t % SPLASH_MULTIPLE == 0 and k_bthk.shape[1] == t)

  def __call__(self, q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array,
               mask: AttentionMask, scale: float) -> jax.Array:
    """Returns the attention output [b, t, h, k] in v's dtype."""
    if not self.handles(mask, q_bthk, k_bthk):
      # Model init and parameter counting trace short dummy inputs; UL2 prefix masks.
      logging.info("SplashAttention: %s mask over %d tokens is not a splash mask; "
                   "using the fallback", "an explicit" if mask.explicit_b1tt is not None
                   else f"a {mask.kind}", q_bthk.shape[1])
      return (self.fallback or XlaDotProductAttention("xla"))(
          q_bthk, k_bthk, v_bthk, mask, scale)
    out_dtype = v_bthk.dtype
    if not target.bf16_matmul_ok():  # Mosaic on TPU v3 has no bf16 matmuls
      q_bthk, k_bthk, v_bthk = (x.astype(jnp.float32) for x in (q_bthk, k_bthk, v_bthk))
    if scale != 1.0:
      q_bthk = (q_bthk * scale).astype(q_bthk.dtype)
    args = (q_bthk, k_bthk, v_bthk)
    if mask.segment_ids_bt is not None:
      args += (mask.segment_ids_bt.astype(jnp.int32),)
    local = lambda *a: self._local(mask.kind == "causal", *a)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
      return local(*args).astype(out_dtype)
    spec_bthk = _spec(mesh, q_bthk.shape, ("batch", None, "act_heads", None))
    spec_bt = PartitionSpec(*spec_bthk[:2])
    in_specs = (spec_bthk,) * 3 + ((spec_bt,) if len(args) == 4 else ())
    return jax.shard_map(local, in_specs=in_specs, out_specs=spec_bthk,
                         check_vma=False)(*args).astype(out_dtype)

  def _local(self, causal: bool, q_bthk, k_bthk, v_bthk, segment_ids_bt=None):
    """Returns out_bthk: the kernel on this device's (or the only) arrays."""
    _, t, h, _ = q_bthk.shape
    shape = (t, t)
    head_mask = splash_mask.CausalMask(shape) if causal else splash_mask.FullMask(shape)
    block = math.gcd(self.block_size, t)
    sizes = splash_kernel.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
        block_kv_dq=block)
    interpret = not target.on_tpu() if self.interpret is None else self.interpret
    kernel = splash_kernel.make_splash_mha(
        splash_mask.MultiHeadMask([head_mask] * h), block_sizes=sizes, head_shards=1,
        q_seq_shards=1, interpret=interpret)
    to_bhtk = lambda x: jnp.swapaxes(x, 1, 2)
    q, k, v = map(to_bhtk, (q_bthk, k_bthk, v_bthk))
    if segment_ids_bt is None:
      out_bhtk = jax.vmap(kernel)(q, k, v)
    else:
      one = lambda q, k, v, s: kernel(q, k, v, segment_ids=splash_kernel.SegmentIds(s, s))
      out_bhtk = jax.vmap(one)(q, k, v, segment_ids_bt)
    return to_bhtk(out_bhtk).astype(v_bthk.dtype)


def _spec(mesh, shape, logical_names) -> PartitionSpec:
  """Returns the shard_map spec of an array with these logical axis names, each
  dimension that does not split evenly over its mesh axes left whole."""
  names = mesh.axis_names
  entries = []
  for size, name in zip(shape, logical_names):
    axes = partitioning.mesh_axes(names, name) if name else ()
    if not axes or size % math.prod(mesh.shape[a] for a in axes):
      entries.append(None)
    else:
      entries.append(axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*entries)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AutoAttention:
  """The default: `SplashAttention()` on TPU (the attached one or the compile
  target) for self-attention over a multiple of 128 tokens with head_dim a
  multiple of 64 (compiled for v3 to v6e at 64 and 128), `XlaDotProductAttention()`
  on the other TPU shapes and on GPU (cuDNN where it can), `PlainAttention()` on
  CPU, where both build the T^2 logits and the plain einsums ran faster: 18 vs 25 ms
  fwd+bwd for [8, 256] tokens x 4 heads of 64, causal, on a 2-core AVX-512 CPU.
  Splash hands prefix-LM masks to XLA."""

  def choose(self, q_bthk: jax.Array, k_bthk: jax.Array) -> Any:
    """Returns the implementation for these queries and keys."""
    t, head_dim = q_bthk.shape[1], q_bthk.shape[-1]
    if (target.on_tpu() and t % SPLASH_MULTIPLE == 0 and k_bthk.shape[1] == t
        and head_dim % 64 == 0):
      return SplashAttention()
    if cpu_target():
      return PlainAttention()
    return XlaDotProductAttention()

  def __call__(self, q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array,
               mask: AttentionMask, scale: float) -> jax.Array:
    """Returns the attention output [b, t, h, k] of the chosen implementation."""
    return self.choose(q_bthk, k_bthk)(q_bthk, k_bthk, v_bthk, mask, scale)


def attention_impl_of(impl: Any) -> Any:
  """Returns `impl` (ModelConfig.attention_impl), or `AutoAttention()` when None."""
  return AutoAttention() if impl is None else impl
