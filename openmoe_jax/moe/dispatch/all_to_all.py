"""Expert parallelism with shard_map and a fixed-capacity `jax.lax.all_to_all`.

Each device builds the capacity buffers [E, g_local, C, d] of its own token groups,
an all-to-all over the expert mesh axis hands every device the buffers of its
E / ep experts from all ep devices [E / ep, ep * g_local, C, d], it runs those
experts, and a second all-to-all brings the outputs home to be combined. Works on
every platform (CPU, TPU v3+, GPU).
"""
import dataclasses

import gin
import jax

from openmoe_jax import partitioning
from openmoe_jax.moe.dispatch.base import ExpertWeights, expert_mlp
from openmoe_jax.moe.dispatch.buffers import BufferDispatcher
from openmoe_jax.moe.dispatch.einsum import EinsumDispatcher
from openmoe_jax.moe.dispatch.primitives import (current_expert_mesh,
                                                 expert_parallel_specs, join_wi_0,
                                                 split_wi_0)
from openmoe_jax.moe.routers import Routing


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AllToAllDispatcher:
  """Expert parallel dispatch: shard_map + fixed-capacity all-to-all over experts.

  Same kept choices, buffers and result as `buffer_dispatcher` (the buffer dispatcher
  that fills and combines each device's local buffers: `EinsumDispatcher()`, the
  default, or `SortDispatcher()`). Without a mesh, or on a mesh whose expert axis has
  size 1, it is just `buffer_dispatcher`. Needs the MoE groups to split evenly over
  the batch axes and the experts over the expert axis.

  Gin: `MoeConfig.dispatcher = @AllToAllDispatcher()`,
  `AllToAllDispatcher.buffer_dispatcher = @SortDispatcher()`.
  """

  buffer_dispatcher: BufferDispatcher = dataclasses.field(
      default_factory=EinsumDispatcher)

  def __call__(self, x_gsd: jax.Array, routing: Routing,
               weights: ExpertWeights) -> jax.Array:
    num_experts = weights.num_experts
    expert_mesh = current_expert_mesh(x_gsd.shape[0], num_experts)
    if expert_mesh is None:
      return self.buffer_dispatcher(x_gsd, routing, weights)
    names = jax.sharding.get_abstract_mesh().axis_names
    group_spec = partitioning.logical_spec(names, "expert_group")
    expert_axis = expert_mesh.axis(expert_mesh.expert_axes)

    def local(x_gsd, routing, weights):
      x_egcd = self.buffer_dispatcher.to_buffers(x_gsd, routing, num_experts)
      # [E, g, C, d] -> [E / ep, ep * g, C, d]: my experts, everyone's groups.
      x_egcd = jax.lax.all_to_all(x_egcd, expert_axis, 0, 1, tiled=True)
      e, g, c, d = x_egcd.shape
      y_end = expert_mlp(join_wi_0(weights), x_egcd.reshape(e, g * c, d))
      y_egcd = jax.lax.all_to_all(y_end.reshape(e, g, c, d), expert_axis, 1, 0,
                                  tiled=True)
      y_gsd = self.buffer_dispatcher.from_buffers(y_egcd, routing, num_experts)
      # Split hidden units give partial sums; summing after the combine moves the
      # fewest bytes.
      if expert_mesh.hidden_axes:
        return jax.lax.psum(y_gsd, expert_mesh.axis(expert_mesh.hidden_axes))
      return y_gsd

    weights = split_wi_0(weights)
    return jax.shard_map(local, in_specs=(group_spec, group_spec,
                                          expert_parallel_specs(weights)),
                         out_specs=group_spec)(x_gsd, routing, weights)
