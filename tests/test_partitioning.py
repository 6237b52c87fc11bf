"""Tests for openmoe_jax.partitioning on 8 emulated CPU devices (see conftest)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from openmoe_jax import partitioning


class _ToyMlp(nn.Module):
  """Uses every kind of annotation the real model uses."""

  @nn.compact
  def __call__(self, x_btd):
    x_btd = nn.with_logical_constraint(x_btd, ("batch", "length", "act_embed"))
    w_df = self.param("wi", nn.with_logical_partitioning(
        nn.initializers.normal(0.02), ("embed", "mlp")), (x_btd.shape[-1], 32))
    w_fd = self.param("wo", nn.with_logical_partitioning(
        nn.initializers.normal(0.02), ("mlp", "embed")), (32, x_btd.shape[-1]))
    h_btf = nn.with_logical_constraint(x_btd @ w_df, ("batch", "length", "act_mlp"))
    return nn.with_logical_constraint(h_btf @ w_fd, ("batch", "length", "act_embed"))


def test_emulated_devices_present():
  assert jax.device_count() == 8


def test_make_mesh_defaults_to_all_devices():
  mesh = partitioning.make_mesh()
  assert mesh.axis_names == ("data",)
  assert mesh.devices.size == 8
  assert partitioning.make_mesh(num_devices=2).devices.size == 2
  with pytest.raises(ValueError):
    partitioning.make_mesh(num_devices=9)
  # At most one -1 degree, filled from the others.
  assert dict(partitioning.make_mesh(expert=2).shape) == {"data": 4, "expert": 2}
  with pytest.raises(ValueError, match="cannot fill the -1 mesh degree: 8 devices are "
                     "not divisible by the fixed degrees"):
    partitioning.make_mesh(expert=3)
  with pytest.raises(ValueError, match="each must be >= 1 except at most one -1"):
    partitioning.make_mesh(fsdp=-1)


def test_rules_on_data_mesh_shard_only_batch():
  rules = dict(partitioning.logical_axis_rules())
  expected = {"vocab", "embed", "heads", "kv", "mlp", "expert", "expert_mlp", "layers",
              "unmodeled", "batch", "length", "act_embed", "act_heads", "act_kv",
              "act_mlp", "expert_group", "expert_buffer_group", "capacity",
              "act_expert"}
  assert set(rules) == expected
  assert rules.pop("batch") == "data"
  assert rules.pop("expert_group") == "data"  # token groups split like the batch
  assert rules.pop("expert_buffer_group") == "data"
  assert all(v is None for v in rules.values())


def test_rules_grow_with_mesh_axes():
  rules = dict(partitioning.logical_axis_rules(("data", "expert", "tensor")))
  assert rules["expert"] == "expert"
  assert rules["act_expert"] == "expert"
  assert rules["mlp"] == "tensor"
  assert rules["batch"] == ("data", "expert")
  assert rules["embed"] is None
  with pytest.raises(ValueError, match="unknown mesh axes"):
    partitioning.logical_axis_rules(("data", "model"))


def test_sharded_init_and_constraints():
  mesh = partitioning.make_mesh()
  model = _ToyMlp()
  x_btd = jnp.ones((16, 4, 8))
  abstract = jax.eval_shape(model.init, jax.random.key(0), x_btd)
  shardings = partitioning.param_shardings(abstract, mesh)
  assert shardings["params"]["wi"] == NamedSharding(mesh, P(None, None))

  with partitioning.activate(mesh):
    params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x_btd)
    x_sharded = jax.device_put(x_btd, partitioning.batch_sharding(mesh))
    apply = jax.jit(model.apply)
    y_btd = apply(params, x_sharded)
    hlo = apply.lower(params, x_sharded).as_text()

  assert isinstance(params["params"]["wi"], nn.LogicallyPartitioned)
  assert params["params"]["wi"].value.sharding.is_fully_replicated
  assert y_btd.sharding.spec == P("data")
  assert "sharding_constraint" in hlo and "{\"data\"}" in hlo
  expected = model.apply(jax.device_get(params), x_btd)
  np.testing.assert_allclose(np.asarray(y_btd), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_unknown_logical_name_is_an_error():
  boxed = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((4, 4), jnp.float32),
                                        ("embed", "mlpp"))}
  with pytest.raises(ValueError, match="'mlpp'"):
    partitioning.param_shardings(boxed, partitioning.make_mesh())


def test_batch_sharding_and_replicated():
  mesh = partitioning.make_mesh()
  assert partitioning.batch_sharding(mesh).spec == P("data")
  assert partitioning.replicated(mesh).spec == P()
  batch = jax.device_put(np.zeros((8, 3), np.int32), partitioning.batch_sharding(mesh))
  assert len(batch.addressable_shards) == 8
  assert batch.addressable_shards[0].data.shape == (1, 3)


def test_optimizer_state_shardings_follow_params():
  import optax  # pylint: disable=g-import-not-at-top
  mesh = partitioning.make_mesh()
  boxed = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((256, 512), jnp.float32),
                                        ("embed", "mlp"))}
  for tx in (optax.adafactor(1e-2), optax.adamw(1e-3)):
    abstract_state = jax.eval_shape(tx.init, boxed)
    shardings = partitioning.param_shardings(abstract_state, mesh)
    flat_state = jax.tree.leaves(nn.unbox(abstract_state))
    flat_shardings = jax.tree.leaves(shardings)
    assert len(flat_state) == len(flat_shardings)
    for leaf, sharding in zip(flat_state, flat_shardings):
      assert len(sharding.spec) <= leaf.ndim


def test_indivisible_dims_stay_whole():
  mesh = partitioning.make_mesh()
  boxed = {"ok": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((16, 3), jnp.float32),
                                         ("batch", "unmodeled")),
           "odd": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((3, 2), jnp.float32),
                                          ("batch", "unmodeled"))}
  shardings = partitioning.param_shardings(boxed, mesh)
  assert shardings["ok"].spec == P("data", None)
  assert shardings["odd"].spec == P(None, None)


def _square_params():
  """Two parameters of one shape with different logical axes, and a vector."""
  box = lambda shape, names: nn.LogicallyPartitioned(
      jax.ShapeDtypeStruct(shape, jnp.float32), names)
  return {"mlp": {"wi": box((32, 32), ("embed", "mlp")),
                  "wo": box((32, 32), ("mlp", "embed"))},
          "norm": {"scale": box((32,), ("embed",))}}


@pytest.mark.parametrize("make_tx", [
    lambda: optax.adamw(1e-3),
    lambda: optax.chain(optax.clip_by_global_norm(1.0),
                        optax.inject_hyperparams(optax.adam)(1e-3)),
    # Each transform's moments mirror only the parameters it owns (the rest are
    # MaskedNodes), so no moment subtree has the whole parameter tree's shape.
    lambda: optax.multi_transform(
        {"adam": optax.adam(1e-3), "momentum": optax.sgd(1e-3, 0.9)},
        {"mlp": {"wi": "adam", "wo": "momentum"}, "norm": {"scale": "adam"}}),
], ids=["adamw", "chain_inject", "multi_transform"])
def test_optimizer_moments_take_their_parameters_shardings(make_tx):
  mesh = partitioning.make_mesh(data=1, fsdp=2, tensor=4)
  boxed = _square_params()
  param_sh = partitioning.param_shardings(boxed, mesh)
  assert param_sh["mlp"]["wi"].spec == P("fsdp", "tensor")
  assert param_sh["mlp"]["wo"].spec == P("tensor", "fsdp")
  abstract = jax.eval_shape(make_tx().init, nn.unbox(boxed))
  shardings = partitioning.opt_state_shardings(abstract, boxed, mesh)
  by_param = {jax.tree_util.keystr(p): s
              for p, s in jax.tree_util.tree_flatten_with_path(param_sh)[0]}
  moments = 0
  for path, sharding in jax.tree_util.tree_flatten_with_path(shardings)[0]:
    name = jax.tree_util.keystr(path)
    owner = [p for p in by_param if name.endswith(p)]
    if owner:  # a moment of that parameter
      moments += 1
      assert sharding == by_param[owner[0]], name
    else:  # counts, hyperparameters
      assert sharding.spec == P(), name
  assert moments >= 3
  # Adam's moment trees, where they mirror the whole parameter tree: leaf for leaf.
  for sub in jax.tree.leaves(shardings, is_leaf=lambda x: hasattr(x, "mu")):
    if hasattr(sub, "mu") and jax.tree.structure(sub.mu) == jax.tree.structure(param_sh):
      assert sub.mu == param_sh and sub.nu == param_sh


def test_factored_moments_are_replicated():
  mesh = partitioning.make_mesh(data=1, fsdp=2, tensor=4)
  boxed = _square_params()
  tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)
  abstract = jax.eval_shape(tx.init, nn.unbox(boxed))
  shardings = partitioning.opt_state_shardings(abstract, boxed, mesh)
  flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
  specs = {jax.tree_util.keystr(path): s.spec for path, s in flat}
  # v_row/v_col of a matrix end with its path but not its shape (here: the vector's).
  factored = [k for k in specs if "v_row" in k or "v_col" in k]
  assert factored and all(specs[k] == P() for k in factored)
  assert [specs[k] for k in specs if k.endswith(".v['norm']['scale']")] == [P("fsdp")]


def test_optimizer_moment_takes_the_longest_matching_parameter_path():
  """A moment of 'mlp/wi' also ends with the path of a top-level 'wi' of the same
  shape; it must take the sharding of 'mlp/wi' (the longest match), not of 'wi'."""
  mesh = partitioning.make_mesh(data=1, fsdp=2, tensor=4)
  box = lambda names: nn.LogicallyPartitioned(
      jax.ShapeDtypeStruct((32, 32), jnp.float32), names)
  boxed = {"wi": box(("embed", "mlp")), "mlp": {"wi": box(("mlp", "embed"))}}
  abstract = jax.eval_shape(optax.adam(1e-3).init, nn.unbox(boxed))
  shardings = partitioning.opt_state_shardings(abstract, boxed, mesh)
  specs = {jax.tree_util.keystr(path): s.spec
           for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
  for moment in ("mu", "nu"):
    assert specs[f"[0].{moment}['wi']"] == P("fsdp", "tensor")
    assert specs[f"[0].{moment}['mlp']['wi']"] == P("tensor", "fsdp")


def test_batch_shards_counts_every_axis_that_splits_the_batch():
  """The batch is split over data, fsdp and expert (never tensor): 8 devices as
  data 2 x expert 4 split it 8 ways, data 2 x fsdp 2 x tensor 2 4 ways, data 2 x
  tensor 4 2 ways."""
  assert partitioning.batch_shards(partitioning.make_mesh()) == 8
  assert partitioning.batch_shards(partitioning.make_mesh(data=2, expert=4)) == 8
  assert partitioning.batch_shards(
      partitioning.make_mesh(data=2, fsdp=2, tensor=2)) == 4
  assert partitioning.batch_shards(partitioning.make_mesh(data=2, tensor=4)) == 2


def test_make_mesh_takes_one_device_up_to_all_and_names_the_range():
  assert partitioning.make_mesh(num_devices=1).devices.size == 1
  assert partitioning.make_mesh(num_devices=8).devices.size == 8
  for bad in (0, 9):
    with pytest.raises(ValueError, match=f"num_devices={bad} but 8 devices exist: "
                       "pick 1 to 8"):
      partitioning.make_mesh(num_devices=bad)


def test_degrees_that_do_not_multiply_to_the_devices_are_refused():
  with pytest.raises(ValueError, match=r"multiply to 4, not to the 8 devices: pick "
                     r"degrees whose product is 8"):
    partitioning.make_mesh(data=2, expert=2)
  with pytest.raises(ValueError, match=r"multiply to 4, not to the 8 devices"):
    partitioning.make_mesh(data=2, dcn_data=2)


def _two_slices_of_v5e_2x2():
  """Returns libtpu's description of two v5e:2x2 slices: 8 chips whose
  `slice_index` is 0 for the first four and 1 for the last four."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2",
                                         num_slices=2).devices
  assert sorted(d.slice_index for d in devices) == [0] * 4 + [1] * 4
  return devices


def test_dcn_degrees_split_an_axis_across_slices():
  """Multi-slice meshes: an axis' size is its ICI degree times its DCN degree, the
  -1 fills from the devices left per slice, and moving along a DCN-split axis
  crosses slices while the ICI axes stay within one."""
  devices = _two_slices_of_v5e_2x2()
  slice_of = np.vectorize(lambda d: d.slice_index)

  mesh = partitioning.make_mesh(dcn_data=2, devices=devices)  # data: 4 ICI x 2 DCN
  assert dict(mesh.shape) == {"data": 8}
  assert slice_of(mesh.devices).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]

  mesh = partitioning.make_mesh(expert=2, dcn_data=2, devices=devices)
  assert dict(mesh.shape) == {"data": 4, "expert": 2}
  assert slice_of(mesh.devices).tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]

  # An axis of ICI degree 1 is kept when its DCN degree splits it.
  mesh = partitioning.make_mesh(data=4, dcn_fsdp=2, devices=devices)
  assert dict(mesh.shape) == {"data": 4, "fsdp": 2}
  assert (slice_of(mesh.devices) == [[0, 1]] * 4).all()


def test_a_state_leaf_at_a_parameters_own_path_takes_its_sharding():
  """A state leaf whose path is exactly a parameter's path (no optimizer prefix)
  takes that parameter's sharding too."""
  mesh = partitioning.make_mesh(data=1, fsdp=2, tensor=4)
  boxed = _square_params()
  params = nn.unbox(boxed)
  shardings = partitioning.opt_state_shardings(
      jax.eval_shape(lambda: params), boxed, mesh)
  assert shardings == partitioning.param_shardings(boxed, mesh)


def test_logical_specs_name_the_present_mesh_axes():
  names = ("data", "fsdp", "expert", "tensor")
  assert partitioning.mesh_axes(names, "batch") == ("data", "fsdp", "expert")
  assert partitioning.mesh_axes(("expert", "data"), "batch") == ("data", "expert")
  assert partitioning.mesh_axes(("data",), "heads") == ()
  spec = partitioning.logical_spec(names, "batch", None, "expert_mlp", "act_expert",
                                   "capacity")
  assert spec == P(("data", "fsdp", "expert"), None, "tensor", "expert", None)
  assert partitioning.logical_spec(("data",), "mlp", "batch") == P(None, "data")
  with pytest.raises(ValueError, match="'token_group'"):
    partitioning.logical_spec(names, "token_group")
