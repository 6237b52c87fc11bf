"""The sparse MoE feed-forward layer: router -> dispatcher -> experts -> combine."""
from typing import Any, Dict, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from openmoe_jax.config import MoeConfig
from openmoe_jax.moe import losses
from openmoe_jax.moe.dispatch import AutoDispatcher, Dispatcher
from openmoe_jax.moe.dispatch.base import expert_mlp
from openmoe_jax.moe.experts import Experts
from openmoe_jax.moe.gates import check_gate_kind, gate_scores
from openmoe_jax.moe.routers import RouterLogits
# Both routing policies, so that gin can name either: MoeConfig.router = @...().
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter  # noqa: F401
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter


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


def router_of(cfg: MoeConfig) -> Any:
  """Returns the routing policy `cfg.router`, or `TokenChoiceRouter()` when None."""
  return TokenChoiceRouter() if cfg.router is None else cfg.router


def dispatcher_of(cfg: MoeConfig) -> Dispatcher:
  """Returns the dispatcher `cfg.dispatcher`, or `AutoDispatcher()` when None."""
  return AutoDispatcher() if cfg.dispatcher is None else cfg.dispatcher


def router_arguments(cfg: MoeConfig, train: bool) -> Dict[str, Any]:
  """Returns the keyword arguments a router is called with (besides the scores and
  `sequence_length`), taken from `cfg` for the training or evaluation phase."""
  return dict(top_k=cfg.top_k, capacity_factor=cfg.capacity_factor(train),
              min_capacity=cfg.min_capacity, renormalize=cfg.renormalize_gates,
              scaling_factor=cfg.routed_scaling_factor)


class MoeLayer(nn.Module):
  """Routed MoE feed-forward (+ optional shared experts): [b, t, d] -> ([b, t, d], aux).

  The routing policy is `config.router` (token choice, the default, or expert
  choice) and the dispatcher `config.dispatcher` (moe/dispatch/; `AutoDispatcher`
  by default), both chosen in gin.
  aux holds float32 scalars `lb_loss`, `z_loss`, `tokenwise_lb_loss`,
  `drop_fraction`, `drop_fraction_{first,last}_quarter`, `router_entropy`,
  `no_expert_fraction`, `experts_per_token_{mean,min,max}` and `expert_load` [E].

  Sown `intermediates/routing` (read with `apply(..., mutable=["intermediates"])`):
  `expert_index`, `gates`, `kept`, each [b, t, k]. Token choice: k = top_k, option j
  is the token's j-th choice. Expert choice: k = E, `expert_index[b, t, e] = e` and
  `kept[b, t, e]` says whether expert e took the token (gate 0 where not).
  Training with `router.jitter_noise > 0` needs a "jitter" rng. Raises ValueError
  for an unknown `config.gate` (or MLP kind) when built.
  """

  config: MoeConfig
  mlp_kind: str
  d_ff: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_btd: jax.Array, *, train: bool
               ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    cfg = self.config
    check_gate_kind(cfg.gate)
    router = router_of(cfg)
    b, t = x_btd.shape[:2]
    x_gsd = group_tokens(x_btd, cfg.group_size)
    x_gsd = nn.with_logical_constraint(x_gsd, ("expert_group", "length", "act_embed"))
    gated_shared = cfg.num_shared_experts if cfg.shared_experts_gated else 0
    # a: the E routed experts, then the `gated_shared` jointly gated shared experts.
    logits_gsa = RouterLogits(cfg.num_experts, cfg.router_init_std, gated_shared,
                              name="router")(self._jitter(x_gsd, router, train))
    scores = gate_scores(logits_gsa, cfg.num_experts, cfg.gate)
    routing, aux = router(scores, **router_arguments(cfg, train), sequence_length=t)
    weights = Experts(cfg.num_experts, self.mlp_kind, self.d_ff, self.dtype,
                      name="experts")(x_gsd.shape[-1])
    y_gsd = dispatcher_of(cfg)(x_gsd, routing, weights)
    if cfg.num_shared_experts:
      y_gsd = y_gsd + self._shared(x_gsd, scores.shared if gated_shared else None)
    aux["z_loss"] = losses.router_z_loss(logits_gsa)
    self.sow("intermediates", "routing", {
        "expert_index": routing.expert_index.reshape(b, t, -1),
        "gates": routing.gates.reshape(b, t, -1),
        "kept": routing.kept.reshape(b, t, -1)})
    return y_gsd.reshape(x_btd.shape).astype(self.dtype), aux

  def _jitter(self, x_gsd: jax.Array, router: Any, train: bool) -> jax.Array:
    """Returns the router input, times U(1 - eps, 1 + eps) noise in training."""
    eps = router.jitter_noise
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
                     self.dtype, name="shared_experts")(d)
    x_Snd = jnp.broadcast_to(x_gsd.reshape(1, g * s, d), (num_shared, g * s, d))
    y_Sgsd = expert_mlp(shared, x_Snd).reshape(num_shared, g, s, d)
    if gates_gsS is None:
      return jnp.sum(y_Sgsd, axis=0)
    return jnp.einsum("Sgsd,gsS->gsd", y_Sgsd, gates_gsS.astype(y_Sgsd.dtype))
