"""The sparse MoE feed-forward layer: router -> dispatcher -> experts -> combine."""
from typing import Any, Dict, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from openmoe_jax.config import MoeConfig
# The expert-parallel dispatchers are imported for their gin registration.
from openmoe_jax.moe import expert_parallel, expert_parallel_ragged  # noqa: F401
from openmoe_jax.moe import losses
from openmoe_jax.moe.experts import Experts
from openmoe_jax.moe.gates import gate_scores
from openmoe_jax.moe.routers import Router


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


class MoeLayer(nn.Module):
  """Routed MoE feed-forward (+ optional shared experts): [b, t, d] -> ([b, t, d], aux).

  The router is `config.router` (token choice or expert choice) and the dispatch
  engine `config.dispatcher` (einsum, sort or ragged), both chosen in gin.
  aux holds float32 scalars `lb_loss`, `z_loss`, `tokenwise_lb_loss`,
  `drop_fraction`, `drop_fraction_{first,last}_quarter`, `router_entropy`,
  `no_expert_fraction`, `experts_per_token_{mean,min,max}` and `expert_load` [E].

  Sown `intermediates/routing` (read with `apply(..., mutable=["intermediates"])`):
  `expert_index`, `gates`, `kept`, each [b, t, k]. Token choice: k = top_k, option j
  is the token's j-th choice. Expert choice: k = E, `expert_index[b, t, e] = e` and
  `kept[b, t, e]` says whether expert e took the token (gate 0 where not).
  Training with `router.jitter_noise > 0` needs a "jitter" rng.
  """

  config: MoeConfig
  mlp_kind: str
  d_ff: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_btd: jax.Array, *, train: bool
               ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    cfg = self.config
    b, t = x_btd.shape[:2]
    x_gsd = group_tokens(x_btd, cfg.group_size)
    x_gsd = nn.with_logical_constraint(x_gsd, ("expert_group", "length", "act_embed"))
    gated_shared = cfg.num_shared_experts if cfg.shared_experts_gated else 0
    logits_gsx = Router(cfg.num_experts, cfg.router_init_std, gated_shared,
                        name="router")(self._jitter(x_gsd, train))
    gs = gate_scores(logits_gsx, cfg.num_experts, cfg.gate)
    routing, aux = cfg.router(gs, cfg, train=train, sequence_length=t)
    experts = Experts(cfg.num_experts, self.mlp_kind, self.d_ff, self.dtype,
                      name="experts")
    y_gsd = cfg.dispatcher(x_gsd, routing, experts, cfg.num_experts)
    if cfg.num_shared_experts:
      y_gsd = y_gsd + self._shared(x_gsd, gs.shared if gated_shared else None)
    aux["z_loss"] = losses.router_z_loss(logits_gsx)
    self.sow("intermediates", "routing", {
        "expert_index": routing.expert_index.reshape(b, t, -1),
        "gates": routing.gates.reshape(b, t, -1),
        "kept": routing.kept.reshape(b, t, -1)})
    return y_gsd.reshape(x_btd.shape).astype(self.dtype), aux

  def _jitter(self, x_gsd: jax.Array, train: bool) -> jax.Array:
    """Returns the router input, times U(1 - eps, 1 + eps) noise in training."""
    eps = self.config.router.jitter_noise
    if not train or not eps:
      return x_gsd
    noise = jax.random.uniform(self.make_rng("jitter"), x_gsd.shape, jnp.float32,
                               1.0 - eps, 1.0 + eps)
    return x_gsd * noise.astype(x_gsd.dtype)

  def _shared(self, x_gsd: jax.Array, gates_gsS) -> jax.Array:
    """Returns the shared experts' summed output [g, s, d] (gated when gates given)."""
    cfg = self.config
    g, s, d = x_gsd.shape
    num_shared = cfg.num_shared_experts
    shared = Experts(num_shared, self.mlp_kind, cfg.shared_expert_d_ff or self.d_ff,
                     self.dtype, name="shared_experts")
    x_Snd = jnp.broadcast_to(x_gsd.reshape(1, g * s, d), (num_shared, g * s, d))
    y_Sgsd = shared(x_Snd).reshape(num_shared, g, s, d)
    if gates_gsS is None:
      return jnp.sum(y_Sgsd, axis=0)
    return jnp.einsum("Sgsd,gsS->gsd", y_Sgsd, gates_gsS.astype(y_Sgsd.dtype))
