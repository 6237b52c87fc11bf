"""Capacity-buffer dispatch: tokens into per-expert buffers [E, g, C, d] and back.

`BufferDispatcher` is the shared half of the einsum and sort dispatchers: a
subclass says how to fill the buffers (`to_buffers`) and how to combine them back
(`from_buffers`); the expert-parallel `AllToAllDispatcher` reuses both halves per
device around its all-to-alls.
"""
import flax.linen as nn
import jax

from openmoe_jax.moe.dispatch.base import ExpertWeights, expert_mlp
from openmoe_jax.moe.routers import Routing

BUFFER_AXES = ("act_expert", "expert_buffer_group", "capacity", "act_embed")
GROUP_AXES = ("expert_group", "length", "act_embed")


class BufferDispatcher:
  """Base of the buffer dispatchers: `to_buffers`, the experts, `from_buffers`.

  Under a mesh (GSPMD expert parallelism) the buffers are constrained to the expert
  layout (experts over the 'expert' mesh axis, groups over the other batch axes) and
  the result back to the token-group layout, so that XLA moves tokens in and out of
  the experts with all-to-alls over 'expert' rather than all-gathers (no-ops outside
  a mesh).
  """

  def __call__(self, x_gsd: jax.Array, routing: Routing,
               weights: ExpertWeights) -> jax.Array:
    num_experts = weights.num_experts
    x_egcd = nn.with_logical_constraint(
        self.to_buffers(x_gsd, routing, num_experts), BUFFER_AXES)
    e, g, c, d = x_egcd.shape
    y_egcd = nn.with_logical_constraint(
        expert_mlp(weights, x_egcd.reshape(e, g * c, d)).reshape(e, g, c, d),
        BUFFER_AXES)
    return nn.with_logical_constraint(
        self.from_buffers(y_egcd, routing, num_experts), GROUP_AXES)

  def to_buffers(self, x_gsd: jax.Array, routing: Routing,
                 num_experts: int) -> jax.Array:
    """Returns the expert buffers [E, g, C, d] (zeros in unused slots)."""
    raise NotImplementedError

  def from_buffers(self, y_egcd: jax.Array, routing: Routing,
                   num_experts: int) -> jax.Array:
    """Returns [g, s, d]: each token's kept expert outputs summed, weighted by gates."""
    raise NotImplementedError
