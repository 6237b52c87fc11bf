"""Experts: the flax module that owns E gated MLPs' parameters.

It only creates (and casts) the weights; the dispatchers apply them with the pure
functions of moe/dispatch/base.py (`expert_mlp`, `expert_mlp_grouped`).
"""
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from openmoe_jax.layers.mlp import mlp_params
from openmoe_jax.moe.dispatch.base import ExpertWeights


class Experts(nn.Module):
  """E gated MLPs' parameters: `experts(d_model)` returns their `ExpertWeights`
  (wi_0 [E, d, F0], wi_1 [E, d, F], wo [E, F, d], cast to `dtype`)."""

  num_experts: int
  kind: str
  d_ff: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, d_model: int) -> ExpertWeights:
    wi_0, wi_1, wo = mlp_params(self, self.kind, d_model, self.d_ff,
                                lead=(self.num_experts,), lead_axes=("expert",),
                                mlp_axis="expert_mlp")
    cast = lambda w: w.astype(self.dtype)
    return ExpertWeights(wi_0=cast(wi_0), wi_1=cast(wi_1), wo=cast(wo), kind=self.kind)
