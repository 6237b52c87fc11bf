"""The sparse MoE feed-forward layer: router -> dispatcher -> experts -> combine."""
from typing import Any, Dict, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from openmoe_jax.config import MoeConfig
from openmoe_jax.layers.mlp import gated_hidden, mlp_params
from openmoe_jax.moe import losses
from openmoe_jax.moe.dispatch import EinsumDispatcher
from openmoe_jax.moe.routers import (Router, expert_capacity, routing_stats,
                                     top_k_capacity_routing)


def group_tokens(x_btd: jax.Array, group_size: int) -> jax.Array:
  """Returns tokens regrouped [g, s, d] in (batch, position) order.

  The group size is capped at the number of tokens; it must divide them.
  """
  b, t, d = x_btd.shape
  n = b * t
  s = min(group_size, n)
  if n % s:
    raise ValueError(f"MoE group_size {group_size} must divide the {n} tokens of a "
                     f"batch ({b} x {t}); pick a divisor such as {t}")
  return x_btd.reshape(n // s, s, d)


class Experts(nn.Module):
  """E gated MLPs applied to per-expert buffers [E, n, d] -> [E, n, d]."""

  num_experts: int
  kind: str
  d_ff: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_end: jax.Array) -> jax.Array:
    wi_0, wi_1, wo = mlp_params(self, self.kind, x_end.shape[-1], self.d_ff,
                                lead=(self.num_experts,), lead_axes=("expert",),
                                mlp_axis="expert_mlp")
    cast = lambda w: w.astype(self.dtype)
    h0 = jnp.einsum("end,edf->enf", x_end, cast(wi_0))
    h1 = jnp.einsum("end,edf->enf", x_end, cast(wi_1))
    h_enf = gated_hidden(self.kind, h0, h1)
    return jnp.einsum("enf,efd->end", h_enf, cast(wo))


class MoeLayer(nn.Module):
  """Token-choice top-k MoE feed-forward: [b, t, d] -> ([b, t, d], aux).

  aux holds the float32 scalars `lb_loss`, `z_loss`, `drop_fraction`,
  `router_entropy` and the vector `expert_load` [E].
  """

  config: MoeConfig
  mlp_kind: str
  d_ff: int
  dtype: Any = jnp.float32
  dispatcher: Any = EinsumDispatcher()

  @nn.compact
  def __call__(self, x_btd: jax.Array, *, train: bool
               ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    cfg = self.config
    x_gsd = group_tokens(x_btd, cfg.group_size)
    x_gsd = nn.with_logical_constraint(x_gsd, ("expert_group", "length", "act_embed"))
    logits_gse = Router(cfg.num_experts, cfg.router_init_std, name="router")(x_gsd)
    probs_gse = jax.nn.softmax(logits_gse, axis=-1)
    capacity = expert_capacity(x_gsd.shape[1], cfg.num_experts,
                               cfg.capacity_factor(train), cfg.min_capacity)
    routing = top_k_capacity_routing(probs_gse, cfg.top_k, capacity,
                                     cfg.renormalize_gates)
    experts = Experts(cfg.num_experts, self.mlp_kind, self.d_ff, self.dtype,
                      name="experts")
    y_gsd = self.dispatcher(x_gsd, routing, experts, cfg.num_experts)
    aux = routing_stats(routing, probs_gse)
    aux["drop_fraction_last_quarter"] = _late_drop_fraction(routing, x_btd.shape[:2])
    aux["lb_loss"] = losses.load_balancing_loss(probs_gse, routing.expert_index)
    aux["z_loss"] = losses.router_z_loss(logits_gse)
    # Per-token routing for analysis: `apply(..., mutable=["intermediates"])`.
    b, t = x_btd.shape[:2]
    self.sow("intermediates", "routing", {
        "expert_index": routing.expert_index.reshape(b, t, -1),
        "gates": routing.gates.reshape(b, t, -1),
        "kept": routing.kept.reshape(b, t, -1)})
    return y_gsd.reshape(x_btd.shape).astype(self.dtype), aux


def _late_drop_fraction(routing, batch_length) -> jax.Array:
  """Returns the drop fraction of (token, choice) pairs in the last quarter of each
  sequence (OpenMoE's drop-towards-the-end)."""
  b, t = batch_length
  kept_btk = routing.kept.reshape(b, t, -1)
  return 1.0 - jnp.mean(kept_btk[:, t - max(t // 4, 1):].astype(jnp.float32))
