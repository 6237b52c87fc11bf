"""Gated MLPs: SwiGLU, GeGLU and OpenMoE's SwiGLU variant.

The math lives in `gated_mlp` over explicit weights so that dense MLPs and experts
(weights with a leading expert axis) share one definition.

OpenMoE's "swiglu" (t5x/flaxformer configs): wi_0 projects d -> 2*d_ff, split into
x1, x2; hidden = x1 * silu(x2) * wi_1(x); out = wo(hidden).
"""
from typing import Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from openmoe_jax.layers.matmul import rows_matmul

MLP_KINDS = ("swiglu", "geglu", "openmoe_swiglu")


def check_mlp_kind(kind: str) -> None:
  """Raises ValueError naming `ModelConfig.mlp_kind` if `kind` is unknown; else None."""
  if kind not in MLP_KINDS:
    raise ValueError(f"ModelConfig.mlp_kind={kind!r}; choose one of {MLP_KINDS}")


def wi_0_width(kind: str, d_ff: int) -> int:
  """Returns the output width of wi_0 for an MLP kind."""
  check_mlp_kind(kind)
  return 2 * d_ff if kind == "openmoe_swiglu" else d_ff


def gated_hidden(kind: str, h0: jax.Array, h1: jax.Array) -> jax.Array:
  """Returns the gated hidden activations from wi_0(x) and wi_1(x)."""
  if kind == "swiglu":
    return nn.silu(h0) * h1
  if kind == "geglu":
    return nn.gelu(h0, approximate=True) * h1
  x1, x2 = jnp.split(h0, 2, axis=-1)
  return x1 * nn.silu(x2) * h1


def mlp_params(module: nn.Module, kind: str, d_model: int, d_ff: int,
               lead: Tuple[int, ...] = (), lead_axes: Tuple[str, ...] = (),
               mlp_axis: str = "mlp"):
  """Creates wi_0, wi_1, wo on `module` (optionally with leading axes); returns them."""
  def make(name, shape, axes, fan_in):
    init = nn.initializers.normal(fan_in ** -0.5)
    return module.param(name, nn.with_logical_partitioning(init, lead_axes + axes),
                        lead + shape, jnp.float32)
  wi_0 = make("wi_0", (d_model, wi_0_width(kind, d_ff)), ("embed", mlp_axis), d_model)
  wi_1 = make("wi_1", (d_model, d_ff), ("embed", mlp_axis), d_model)
  wo = make("wo", (d_ff, d_model), (mlp_axis, "embed"), d_ff)
  return wi_0, wi_1, wo


class Mlp(nn.Module):
  """Dense gated MLP block: [b, t, d] -> [b, t, d]."""

  kind: str
  d_ff: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_btd: jax.Array) -> jax.Array:
    wi_0, wi_1, wo = mlp_params(self, self.kind, x_btd.shape[-1], self.d_ff)
    cast = lambda w: w.astype(self.dtype)
    h0 = rows_matmul(x_btd, cast(wi_0))
    h1 = rows_matmul(x_btd, cast(wi_1))
    h_btf = gated_hidden(self.kind, h0, h1)
    h_btf = nn.with_logical_constraint(h_btf, ("batch", "length", "act_mlp"))
    return rows_matmul(h_btf, cast(wo))
