"""Pieces every dispatcher shares: sort by expert, gate-weighted combine, the mesh
tests and shard_map specs of expert parallelism, backend checks.

The mesh axes come from partitioning's rules: token groups split like the batch
('expert_group'), experts over the 'act_expert' axes, the expert hidden over the
'expert_mlp' axes.
"""
import logging
import math
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from openmoe_jax import partitioning
from openmoe_jax.kernels.grouped_matmul import BACKENDS
from openmoe_jax.moe.dispatch.base import ExpertWeights
from openmoe_jax.moe.routers import Routing


def check_backend(owner: str, backend: str) -> None:
  """Raises ValueError naming `owner.backend` unless it is a grouped_matmul backend."""
  if backend not in BACKENDS:
    raise ValueError(f"{owner}.backend={backend!r}; choose one of {BACKENDS}")


def auto_tile(num_rows: int, num_experts: int) -> int:
  """Returns the padded backend's tile: the mean group size rounded down to a power of
  two, within [8, 128] (small tiles waste less padding, large ones loop less)."""
  mean = max(num_rows // num_experts, 1)
  return min(max(1 << (mean.bit_length() - 1), 8), 128)


def max_kept_rows(routing: Routing, num_tokens: int, num_experts: int) -> int:
  """Returns the static bound on kept (token, option) rows of `num_tokens` tokens
  (all groups): every option of every token, or every expert's capacity in every
  group, whichever is fewer."""
  num_groups, _, k = routing.expert_index.shape
  return min(num_tokens * k, num_groups * num_experts * routing.capacity)


def sort_by_expert(routing: Routing, num_experts: int) -> Tuple[jax.Array, jax.Array]:
  """Returns (order_m, counts_e): the (token, option) rows m = s' * k + j of all
  groups, kept ones sorted by expert (stable; unkept ones last), and the number of
  kept rows per expert [E]."""
  key_m = jnp.where(routing.kept, routing.expert_index, num_experts).reshape(-1)
  order_m = jnp.argsort(key_m, stable=True)
  counts_e = jnp.bincount(key_m, length=num_experts + 1)[:num_experts]
  return order_m, counts_e


def combine_rows(y_rd: jax.Array, order_r: jax.Array, routing: Routing,
                 num_tokens: int) -> jax.Array:
  """Returns [num_tokens, d]: each token's rows of y_rd (rows in `order_r` order of
  the (token, option) rows) summed, weighted by their gates."""
  k = routing.expert_index.shape[-1]
  gate_r = routing.gates.reshape(-1)[order_r].astype(y_rd.dtype)
  return jnp.zeros((num_tokens, y_rd.shape[-1]), y_rd.dtype).at[order_r // k].add(
      y_rd * gate_r[:, None])


def expert_split_size(mesh) -> int:
  """Returns the number of devices the experts are split over on `mesh` (1 if none)."""
  if mesh.empty:
    return 1
  axes = partitioning.mesh_axes(mesh.axis_names, "act_expert")
  return math.prod(mesh.shape[a] for a in axes)


def group_spec(mesh, num_groups: int) -> PartitionSpec:
  """Returns the shard_map spec of [g, ...] token groups: split like the batch, or
  whole on every device when the groups do not split evenly (e.g. at init)."""
  names = mesh.axis_names
  axes = partitioning.mesh_axes(names, "expert_group")
  if num_groups % math.prod(mesh.shape[a] for a in axes):
    return PartitionSpec()
  return partitioning.logical_spec(names, "expert_group")


class ExpertMesh(NamedTuple):
  """The mesh axes an expert-parallel dispatch uses (as partitioning maps them)."""

  group_axes: Tuple[str, ...]  # token groups (the batch axes)
  expert_axes: Tuple[str, ...]  # experts
  hidden_axes: Tuple[str, ...]  # expert hidden units
  expert_size: int  # devices the experts are split over

  def axis(self, axes: Tuple[str, ...]):
    """Returns `axes` as a collective's axis_name (a name or a tuple)."""
    return axes[0] if len(axes) == 1 else axes


def current_expert_mesh(num_groups: int, num_experts: int) -> Optional[ExpertMesh]:
  """Returns the ExpertMesh of the current mesh (`jax.set_mesh`, e.g. through
  `partitioning.activate`), or None when there is no mesh, the experts are not split,
  or the `num_groups` token groups do not split evenly over the batch axes (e.g.
  the one-sequence batch of initialisation): the caller then dispatches without
  shard_map, which gives the same result. Raises ValueError when the experts do not
  split evenly over the expert axes."""
  mesh = jax.sharding.get_abstract_mesh()
  ep = expert_split_size(mesh)
  if ep <= 1:
    return None
  names = mesh.axis_names
  expert = partitioning.mesh_axes(names, "act_expert")
  if num_experts % ep:
    raise ValueError(f"expert parallelism: {num_experts} experts do not split over "
                     f"{ep} devices of mesh axes {expert}")
  group = partitioning.mesh_axes(names, "expert_group")
  groups = math.prod(mesh.shape[a] for a in group)
  if num_groups % groups:
    logging.info("expert parallelism off: %d MoE groups do not split over %d devices",
                 num_groups, groups)
    return None
  return ExpertMesh(group, expert, partitioning.mesh_axes(names, "expert_mlp"), ep)


def split_wi_0(weights: ExpertWeights) -> ExpertWeights:
  """Returns the weights with wi_0 as [E, d, m, F] (m = 1, or 2 for OpenMoE's SwiGLU
  whose wi_0 holds two halves), so that splitting F over devices keeps the halves
  paired; `join_wi_0` undoes it on the local shard."""
  e, d, f = weights.wi_1.shape
  return weights.replace(wi_0=weights.wi_0.reshape(e, d, -1, f))


def join_wi_0(weights: ExpertWeights) -> ExpertWeights:
  """Returns the local weights with wi_0 back as [E, d, m * F]."""
  e, d, m, f = weights.wi_0.shape
  return weights.replace(wi_0=weights.wi_0.reshape(e, d, m * f))


def expert_parallel_specs(weights: ExpertWeights) -> ExpertWeights:
  """Returns shard_map specs for `split_wi_0(weights)`: experts and hidden split, the
  model dimension whole (gathered over fsdp before the shard_map)."""
  names = jax.sharding.get_abstract_mesh().axis_names
  spec = lambda *axes: partitioning.logical_spec(names, *axes)
  return weights.replace(wi_0=spec("expert", None, None, "expert_mlp"),
                         wi_1=spec("expert", None, "expert_mlp"),
                         wo=spec("expert", "expert_mlp", None))
