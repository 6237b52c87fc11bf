"""Routers: token-choice top-k with ST-MoE capacity and priority.

A router turns router probabilities into a `Routing`: for each token (grouped
[g, s]) and each of its k choices, the expert, the slot in that expert's buffer,
whether the choice was kept (slot < capacity) and its combine weight. Dispatch
engines (dispatch.py) consume a `Routing` and never re-decide drops.
"""
from typing import Dict

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Routing:
  """Routing decisions for grouped tokens; all arrays are [g, s, k]."""

  expert_index: jax.Array  # int32 chosen expert
  slot: jax.Array  # int32 position in the expert's buffer (valid where kept)
  kept: jax.Array  # bool: served within capacity
  gates: jax.Array  # float32 combine weight, 0 where dropped
  capacity: int = flax.struct.field(pytree_node=False)


def expert_capacity(tokens_per_group: int, num_experts: int, capacity_factor: float,
                    min_capacity: int) -> int:
  """Returns max(round(capacity_factor * tokens_per_group / num_experts), min_capacity)."""
  return max(int(round(capacity_factor * tokens_per_group / num_experts)), min_capacity)


def top_k_capacity_routing(probs_gse: jax.Array, top_k: int, capacity: int,
                           renormalize: bool = False) -> Routing:
  """Returns ST-MoE token-choice routing with capacity.

  Priority as in flaxformer: every token's 1st choice is served before any token's
  2nd choice, and within one choice rank tokens are served in sequence order. A
  choice whose expert is already full is dropped (its gate becomes 0). Gates are the
  router probabilities of the chosen experts, optionally renormalised over the top-k
  (before dropping).
  """
  g, s, num_experts = probs_gse.shape
  gates_gsk, expert_gsk = jax.lax.top_k(probs_gse.astype(jnp.float32), top_k)
  if renormalize:
    gates_gsk = gates_gsk / jnp.sum(gates_gsk, axis=-1, keepdims=True)
  onehot_gkse = jax.nn.one_hot(jnp.swapaxes(expert_gsk, 1, 2), num_experts,
                               dtype=jnp.int32)
  # Cumulative count over (choice rank, position): rank-major priority order.
  order_gne = onehot_gkse.reshape(g, top_k * s, num_experts)
  position_gne = jnp.cumsum(order_gne, axis=1) - 1
  slot_gks = jnp.sum(position_gne * order_gne, axis=-1).reshape(g, top_k, s)
  slot_gsk = jnp.swapaxes(slot_gks, 1, 2).astype(jnp.int32)
  kept_gsk = slot_gsk < capacity
  return Routing(expert_index=expert_gsk.astype(jnp.int32), slot=slot_gsk,
                 kept=kept_gsk, gates=jnp.where(kept_gsk, gates_gsk, 0.0),
                 capacity=capacity)


def routing_stats(routing: Routing, probs_gse: jax.Array) -> Dict[str, jax.Array]:
  """Returns drop_fraction, expert_load [E] (share of top-k choices, sums to 1) and
  router_entropy (mean over tokens, nats)."""
  num_experts = probs_gse.shape[-1]
  load_e = jnp.mean(jax.nn.one_hot(routing.expert_index, num_experts,
                                   dtype=jnp.float32), axis=(0, 1, 2))
  probs = probs_gse.astype(jnp.float32)
  entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-9)), axis=-1)
  return {
      "drop_fraction": 1.0 - jnp.mean(routing.kept.astype(jnp.float32)),
      "expert_load": load_e,
      "router_entropy": jnp.mean(entropy),
  }


class Router(nn.Module):
  """Linear router without bias, in float32: [g, s, d] -> logits [g, s, E]."""

  num_experts: int
  init_std: float = 0.02

  @nn.compact
  def __call__(self, x_gsd: jax.Array) -> jax.Array:
    w_de = self.param(
        "w", nn.with_logical_partitioning(nn.initializers.normal(self.init_std),
                                          ("embed", "unmodeled")),
        (x_gsd.shape[-1], self.num_experts), jnp.float32)
    return jnp.einsum("gsd,de->gse", x_gsd.astype(jnp.float32), w_de)
