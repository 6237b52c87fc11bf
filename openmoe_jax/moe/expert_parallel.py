"""Expert parallelism with shard_map and a fixed-capacity `jax.lax.all_to_all`.

Each device builds the capacity buffers [E, g_local, C, d] of its own token groups,
an all-to-all over the expert mesh axis hands every device the buffers of its
E / ep experts from all ep devices [E / ep, ep * g_local, C, d], it runs those
experts, and a second all-to-all brings the outputs home to be combined. Works on
every platform (CPU, TPU v3+, GPU). The mesh axes come from partitioning's rules:
groups split like the batch, experts over the 'act_expert' axes, the expert hidden
over the 'expert_mlp' axes (partial outputs summed with psum).
"""
import dataclasses
import logging
import math
from typing import Any, NamedTuple, Tuple

import gin
import jax
from jax.sharding import PartitionSpec

from openmoe_jax import partitioning
from openmoe_jax.moe.dispatch import EinsumDispatcher
from openmoe_jax.moe.experts import expert_mlp
from openmoe_jax.moe.routers import Routing


class ExpertMesh(NamedTuple):
  """The mesh axes an expert-parallel dispatch uses (names as partitioning maps them)."""

  group_axes: Tuple[str, ...]  # token groups (the batch axes)
  expert_axes: Tuple[str, ...]  # experts
  hidden_axes: Tuple[str, ...]  # expert hidden units
  expert_size: int  # devices the experts are split over

  def axis(self, axes: Tuple[str, ...]):
    """Returns `axes` as a collective's axis_name (a name or a tuple)."""
    return axes[0] if len(axes) == 1 else axes


def current_expert_mesh(num_groups: int, num_experts: int):
  """Returns the ExpertMesh of the current mesh (`jax.set_mesh`, e.g. through
  `partitioning.activate`), or None when there is no mesh, the experts are not split,
  or the `num_groups` token groups do not split evenly over the batch axes (e.g.
  the one-sequence batch of initialisation): the caller then dispatches without
  shard_map, which gives the same result. Raises ValueError when the experts do not
  split evenly over the expert axes."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  names = mesh.axis_names
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  group = partitioning.mesh_axes(names, "expert_group")
  expert = partitioning.mesh_axes(names, "act_expert")
  hidden = partitioning.mesh_axes(names, "expert_mlp")
  if size(expert) <= 1:
    return None
  if num_experts % size(expert):
    raise ValueError(f"expert parallelism: {num_experts} experts do not split over "
                     f"{size(expert)} devices of mesh axes {expert}")
  if num_groups % size(group):
    logging.info("expert parallelism off: %d MoE groups do not split over %d devices",
                 num_groups, size(group))
    return None
  return ExpertMesh(group, expert, hidden, size(expert))


def split_weights(experts: Any, d_model: int):
  """Returns the experts' weights with wi_0 as [E, d, m, F] (m = 1, or 2 for OpenMoE's
  SwiGLU whose wi_0 holds two halves), so that splitting F over devices keeps the
  halves paired; `join_wi_0` undoes it on the local shard."""
  wi_0, wi_1, wo = experts.weights(d_model)
  e, d, f = wi_1.shape
  return wi_0.reshape(e, d, -1, f), wi_1, wo


def join_wi_0(wi_0_edmf: jax.Array) -> jax.Array:
  """Returns the local wi_0 [E, d, m * F] from its [E, d, m, F] form."""
  e, d, m, f = wi_0_edmf.shape
  return wi_0_edmf.reshape(e, d, m * f)


def weight_specs(names) -> Tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
  """Returns shard_map specs of (wi_0 [E, d, m, F], wi_1, wo): experts and hidden
  split, the model dimension whole (gathered over fsdp before the shard_map)."""
  spec = lambda *axes: partitioning.logical_spec(names, *axes)
  return (spec("expert", None, None, "expert_mlp"), spec("expert", None, "expert_mlp"),
          spec("expert", "expert_mlp", None))


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AllToAllDispatcher:
  """Expert parallel dispatch: shard_map + fixed-capacity all-to-all over experts.

  Same kept choices, buffers and result as `buffers` (the dispatch engine that builds
  and combines each device's local buffers: `EinsumDispatcher()`, the default, or
  `SortDispatcher()`). Without a mesh, or on a mesh whose expert axis has size 1, it
  is just `buffers`. Needs the MoE groups to split evenly over the batch axes and the
  experts over the expert axis.

  Gin: `MoeConfig.dispatcher = @AllToAllDispatcher()`,
  `AllToAllDispatcher.buffers = @SortDispatcher()`.
  """

  buffers: Any = dataclasses.field(default_factory=EinsumDispatcher)

  def __call__(self, x_gsd: jax.Array, routing: Routing, experts: Any,
               num_experts: int) -> jax.Array:
    em = current_expert_mesh(x_gsd.shape[0], num_experts)
    if em is None:
      return self.buffers(x_gsd, routing, experts, num_experts)
    weights = split_weights(experts, x_gsd.shape[-1])
    names = jax.sharding.get_abstract_mesh().axis_names
    group_spec = partitioning.logical_spec(names, "expert_group")

    def local(x_gsd, routing, wi_0, wi_1, wo):
      x_egcd = self.buffers.to_buffers(x_gsd, routing, num_experts)
      # [E, g, C, d] -> [E / ep, ep * g, C, d]: my experts, everyone's groups.
      x_egcd = jax.lax.all_to_all(x_egcd, em.axis(em.expert_axes), 0, 1, tiled=True)
      e, g, c, d = x_egcd.shape
      y_end = expert_mlp(experts.kind, x_egcd.reshape(e, g * c, d), join_wi_0(wi_0),
                         wi_1, wo)
      y_egcd = jax.lax.all_to_all(y_end.reshape(e, g, c, d), em.axis(em.expert_axes),
                                  1, 0, tiled=True)
      y_gsd = self.buffers.from_buffers(y_egcd, routing, num_experts)
      # Split hidden units give partial sums; summing after the combine moves the
      # fewest bytes.
      return jax.lax.psum(y_gsd, em.axis(em.hidden_axes)) if em.hidden_axes else y_gsd

    return jax.shard_map(local, in_specs=(group_spec, group_spec) + weight_specs(names),
                         out_specs=group_spec)(x_gsd, routing, *weights)
