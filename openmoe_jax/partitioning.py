"""Device mesh and logical axis rules: the one place logical names meet mesh axes.

Model code names parameter axes with `nn.with_logical_partitioning` and activation axes
with `nn.with_logical_constraint`; nothing outside this module mentions a mesh axis.
The rules are derived from `LOGICAL_AXES` for whichever mesh axes exist, so adding a
mesh axis (fsdp, expert, tensor) only changes the mesh, never the model code.
"""
import contextlib
import math
from collections.abc import Iterator, Sequence

import flax.linen as nn
import gin
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Mesh axis names this library knows, outermost first.
MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical axis -> mesh axes it may be sharded over, in order. Mesh axes that are absent
# from the current mesh are dropped; a logical axis left with none is replicated.
LOGICAL_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Parameters.
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv", ()),
    ("mlp", ("tensor",)),
    ("expert", ("expert",)),
    ("expert_mlp", ("tensor",)),
    ("layers", ()),  # the nn.scan axis stays whole on every device
    ("unmodeled", ()),
    # Activations. Under expert parallelism the batch is also split over 'expert'
    # (t5x contrib/moe: batch -> (expert, data)).
    ("batch", ("data", "fsdp", "expert")),
    ("length", ()),
    ("act_embed", ()),
    ("act_heads", ("tensor",)),
    ("act_kv", ()),
    ("act_mlp", ("tensor",)),
    # MoE dispatch. Token groups [g, s, d] are split like the batch. Inside the expert
    # buffers [E, g, C, d] the expert dimension takes the 'expert' mesh axis and the
    # groups keep only the other batch axes, so moving between the two layouts is an
    # all-to-all over 'expert' (t5x contrib/moe), never an all-gather.
    ("expert_group", ("data", "fsdp", "expert")),
    ("expert_buffer_group", ("data", "fsdp")),
    ("capacity", ()),
    ("act_expert", ("expert",)),
)

LogicalRules = list[tuple[str, str | tuple[str, ...] | None]]


def logical_axis_rules(mesh_axis_names: Sequence[str] = ("data",)) -> LogicalRules:
  """Returns flax logical axis rules [(logical_name, mesh_axes or None), ...].

  Each logical axis maps to the subset of its candidate mesh axes present in
  `mesh_axis_names`: None when there is none, a name when one, a tuple when several.
  """
  unknown = set(mesh_axis_names) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; known: {MESH_AXES}")
  rules = []
  for logical, candidates in LOGICAL_AXES:
    present = tuple(a for a in candidates if a in mesh_axis_names)
    rules.append((logical, present[0] if len(present) == 1 else (present or None)))
  return rules


@gin.configurable
def make_mesh(num_devices: int | None = None, data: int = -1, fsdp: int = 1,
              expert: int = 1, tensor: int = 1, dcn_data: int = 1, dcn_fsdp: int = 1,
              dcn_expert: int = 1, dcn_tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Returns a mesh over the first `num_devices` of `devices` (default: all of
  `jax.devices()`; the planner passes a TPU topology's devices).

  Each of the axes data, fsdp, expert, tensor has an ICI degree (within a slice) and
  a DCN degree (across slices, multi-slice only); at most one ICI degree may be -1,
  filled so the degrees multiply to the device count. Axes of total size 1 are left
  out except 'data', so the default is the one-axis ('data',) mesh. Device order
  comes from `mesh_utils` (physical torus order on TPU). Axes are Auto (GSPMD
  propagation), not the Explicit default of `jax.make_mesh`.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices) if num_devices is None else num_devices
  if not 1 <= n <= len(devices):
    raise ValueError(f"train.num_devices={num_devices} but {len(devices)} devices "
                     f"exist: pick 1 to {len(devices)} (or None: all)")
  dcn = (dcn_data, dcn_fsdp, dcn_expert, dcn_tensor)
  ici = _fill_auto_degree((data, fsdp, expert, tensor), n // math.prod(dcn))
  if math.prod(ici) * math.prod(dcn) != n:
    raise ValueError(f"make_mesh degrees ici={dict(zip(MESH_AXES, ici))} x "
                     f"dcn={dict(zip(MESH_AXES, dcn))} multiply to "
                     f"{math.prod(ici) * math.prod(dcn)}, not to the {n} devices: pick "
                     f"degrees whose product is {n} (or -1 for one of data, fsdp, "
                     "expert, tensor to fill)")
  if math.prod(dcn) > 1:
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices[:n])
  else:
    grid = _ici_device_grid(ici, devices[:n])
  keep = [i for i, name in enumerate(MESH_AXES)
          if name == "data" or ici[i] * dcn[i] > 1]
  shape = tuple(ici[i] * dcn[i] for i in keep)
  return Mesh(grid.reshape(shape), tuple(MESH_AXES[i] for i in keep))


def _ici_device_grid(ici: Sequence[int], devices) -> np.ndarray:
  """Returns devices arranged as `ici` in physical (torus) order where mesh_utils
  knows the platform, else in enumeration order."""
  try:
    return mesh_utils.create_device_mesh(ici, devices)
  except AssertionError:
    # libtpu's v4 topology descriptions list both cores of a chip, which mesh_utils
    # rejects (it expects megacore); enumeration order keeps a chip's cores adjacent.
    return np.array(devices).reshape(ici)


def _fill_auto_degree(degrees: Sequence[int], total: int) -> tuple[int, ...]:
  """Returns `degrees` with the single -1 replaced so that they multiply to total."""
  auto = [i for i, d in enumerate(degrees) if d == -1]
  if len(auto) > 1 or any(d < 1 for d in degrees if d != -1):
    raise ValueError(f"mesh degrees {dict(zip(MESH_AXES, degrees))}: each must be >= 1 "
                     "except at most one -1 (auto)")
  if not auto:
    return tuple(degrees)
  fixed = math.prod(d for d in degrees if d != -1)
  if total % fixed:
    raise ValueError(f"cannot fill the -1 mesh degree: {total} devices are not "
                     f"divisible by the fixed degrees {dict(zip(MESH_AXES, degrees))}")
  return tuple(total // fixed if d == -1 else d for d in degrees)


def batch_shards(mesh: Mesh) -> int:
  """Returns how many ways the batch dimension is split on `mesh`."""
  return _mesh_size(mesh, nn.logical_to_mesh_axes(
      ("batch",), logical_axis_rules(mesh.axis_names))[0])


def _check_known_names(names: Sequence, where) -> None:
  known = {name for name, _ in LOGICAL_AXES}
  for axis in names:
    for name in axis if isinstance(axis, tuple) else (axis,):
      if name is not None and name not in known:
        raise ValueError(f"logical axis {name!r} (in {where}) has no rule in "
                         f"partitioning.LOGICAL_AXES; known: {sorted(known)}")


def _mesh_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  names = axes if isinstance(axes, tuple) else (axes,)
  return int(np.prod([mesh.shape[name] for name in names]))


def param_shardings(abstract_boxed_tree, mesh: Mesh):
  """Returns a pytree of NamedSharding for (abstract) boxed params or train state.

  `abstract_boxed_tree` is typically `jax.eval_shape(model.init, ...)`, or a state
  built from it: leaves boxed in `nn.LogicallyPartitioned` get the sharding of their
  logical names; unboxed leaves are replicated, and so are boxed leaves whose rank
  differs from their names (Adafactor's factored moments inherit the param's box).
  A dimension its mesh axes do not divide evenly stays whole (e.g. Adafactor's size-1
  placeholders). The result mirrors the unboxed tree, a valid prefix for
  `jax.jit(init, out_shardings=...)` of the boxed output. Raises ValueError for a
  logical name missing from LOGICAL_AXES (flax would silently replicate it).
  """
  rules = logical_axis_rules(mesh.axis_names)

  def sharding(leaf):
    if not isinstance(leaf, nn.Partitioned):
      return replicated(mesh)
    spec = leaf.get_partition_spec()
    _check_known_names(spec, spec)
    shape = leaf.value.shape
    if len(spec) != len(shape):
      return replicated(mesh)
    mesh_spec = nn.logical_to_mesh_axes(spec, rules)
    return NamedSharding(mesh, PartitionSpec(*(
        axes if size % _mesh_size(mesh, axes) == 0 else None
        for axes, size in zip(mesh_spec, shape))))

  return jax.tree.map(sharding, abstract_boxed_tree,
                      is_leaf=lambda x: isinstance(x, nn.Partitioned))


def opt_state_shardings(abstract_opt_state, abstract_boxed_params, mesh: Mesh):
  """Returns a pytree of NamedSharding for an (abstract) optimizer state.

  Optimizer states mirror the parameters in their moment subtrees (Adam's mu and nu,
  inside whatever chain, mask or multi_transform holds them): a leaf whose tree path
  ends with a parameter's path and whose shape is that parameter's gets the sharding
  of the parameter's logical axes (`param_shardings`); every other leaf (step counts,
  hyperparameters, Adafactor's factored moments) is replicated. When several
  parameter paths end a leaf's path, the longest wins.
  """
  is_box = lambda x: isinstance(x, nn.Partitioned)
  by_path = {}
  for (path, box), sharding in zip(
      jax.tree_util.tree_flatten_with_path(abstract_boxed_params, is_leaf=is_box)[0],
      jax.tree.leaves(param_shardings(abstract_boxed_params, mesh))):
    value = box.value if is_box(box) else box
    by_path[tuple(path)] = (value.shape, sharding)
  lengths = sorted({len(path) for path in by_path}, reverse=True)

  def sharding(path, leaf):
    for n in lengths:
      if n <= len(path) and tuple(path[len(path) - n:]) in by_path:
        shape, param_sharding = by_path[tuple(path[len(path) - n:])]
        return param_sharding if shape == leaf.shape else replicated(mesh)
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(sharding, abstract_opt_state)


def mesh_axes(mesh_axis_names: Sequence[str], logical_name: str) -> tuple[str, ...]:
  """Returns the mesh axes (those present in `mesh_axis_names`) that the rules map
  `logical_name` to, in order; () when it is replicated."""
  _check_known_names((logical_name,), "mesh_axes")
  candidates = dict(LOGICAL_AXES)[logical_name]
  return tuple(a for a in candidates if a in mesh_axis_names)


def logical_spec(mesh_axis_names: Sequence[str], *logical_names: str | None
                 ) -> PartitionSpec:
  """Returns the PartitionSpec of an array whose axes have the given logical names
  (None: replicated), e.g. for `jax.shard_map` in/out specs."""
  _check_known_names(logical_names, "logical_spec")
  def entry(name):
    axes = mesh_axes(mesh_axis_names, name) if name is not None else ()
    return None if not axes else axes[0] if len(axes) == 1 else axes
  return PartitionSpec(*map(entry, logical_names))


def logical_sharding(mesh: Mesh, *logical_names: str | None) -> NamedSharding:
  """Returns the NamedSharding of an array whose axes have the given logical names."""
  spec = nn.logical_to_mesh_axes(logical_names, logical_axis_rules(mesh.axis_names))
  return NamedSharding(mesh, spec)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Returns the sharding of input batches: leading (batch) dim split, rest whole."""
  return logical_sharding(mesh, "batch")


def replicated(mesh: Mesh) -> NamedSharding:
  """Returns a sharding that puts a full copy on every device of `mesh`."""
  return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def activate(mesh: Mesh) -> Iterator[Mesh]:
  """Context manager making `mesh` current and its logical axis rules active.

  Inside it, `nn.with_logical_constraint` in model code becomes a real sharding
  constraint (outside any mesh flax makes it a no-op). Yields the mesh.
  """
  with jax.set_mesh(mesh), nn.logical_axis_rules(logical_axis_rules(mesh.axis_names)):
    yield mesh
