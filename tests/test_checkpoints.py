"""Tests for openmoe_jax.checkpoints: bit-exact round trip, pruning, resume."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from openmoe_jax import checkpoints, partitioning


def _state(mesh, seed=0):
  key = jax.random.key(seed)
  params = {
      "embed": jax.device_put(jax.random.normal(key, (16, 4), jnp.bfloat16),
                              NamedSharding(mesh, P("data"))),
      "scale": jnp.linspace(0.0, 1.0, 4, dtype=jnp.float32),
  }
  return {"step": jnp.asarray(seed, jnp.int32), "params": params,
          "opt_state": optax.adam(1e-3).init(params)}


def _assert_bit_exact(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_restores_values_and_shardings(tmp_path):
  mesh = partitioning.make_mesh()
  state = _state(mesh, seed=3)
  with checkpoints.Checkpointer(tmp_path, save_every_steps=10, keep=2) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(10, state, {"examples_seen": 1280, "epoch": 0})
    ckpt.wait_until_finished()

    shardings = partitioning.param_shardings(state, mesh)
    shardings["params"]["embed"] = NamedSharding(mesh, P("data"))
    abstract = checkpoints.abstract_with_shardings(state, shardings)
    restored, position = ckpt.restore(abstract_state=abstract)

  _assert_bit_exact(state, restored)
  assert position == {"examples_seen": 1280, "epoch": 0}
  assert restored["params"]["embed"].sharding == NamedSharding(mesh, P("data"))
  assert restored["params"]["scale"].sharding.is_fully_replicated


def test_interval_force_and_keep_last_k(tmp_path):
  mesh = partitioning.make_mesh()
  state = _state(mesh)
  with checkpoints.Checkpointer(tmp_path, save_every_steps=2, keep=2) as ckpt:
    saved = [step for step in range(1, 8) if ckpt.save(step, state, {"step": step})]
    assert saved == [2, 4, 6]
    assert ckpt.save(7, state, {"step": 7}, force=True)

  with checkpoints.Checkpointer(tmp_path, save_every_steps=2, keep=2) as resumed:
    assert resumed.all_steps() == [6, 7]
    assert resumed.latest_step() == 7
    abstract = jax.eval_shape(lambda: state)
    _, position = resumed.restore(abstract_state=abstract)
    assert position == {"step": 7}
    _, position = resumed.restore(6, abstract_state=abstract)
    assert position == {"step": 6}


def test_defaults_save_every_1000_steps_and_keep_three(tmp_path):
  state = {"w": jnp.zeros((2,))}
  with checkpoints.Checkpointer(tmp_path) as ckpt:
    assert [s for s in (1, 999, 1000, 1001, 2000) if ckpt.is_save_due(s)] == [1000, 2000]
    for step in (1, 2, 3, 4):
      assert ckpt.save(step, state, force=True)
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [2, 3, 4]
  with pytest.raises(ValueError, match="save_every_steps must be >= 1, got 0"):
    checkpoints.Checkpointer(tmp_path, save_every_steps=0)


def test_restore_without_checkpoint_raises(tmp_path):
  with checkpoints.Checkpointer(tmp_path) as ckpt:
    with pytest.raises(FileNotFoundError):
      ckpt.restore()


def test_replicated_arrays_are_written_in_parts_only_when_the_parts_are_large(
    tmp_path, monkeypatch):
  """On 8 data-parallel replicas a small replicated array is written whole by one
  replica (Orbax's default slices it into 8 parts, one compiled slice per shape and
  device); an array whose parts reach REPLICA_PARALLEL_MIN_SLICE_BYTES (1 MiB) is
  still written in 8 parts. Both round-trip exactly."""
  from orbax.checkpoint._src.serialization import replica_slices  # pylint: disable=g-import-not-at-top
  in_parts = {}
  original = replica_slices.get_replica_slices

  def recording(arr, *args, **kwargs):
    result = original(arr, *args, **kwargs)
    in_parts[arr.shape] = len(result.replica_slices)
    return result

  monkeypatch.setattr(replica_slices, "get_replica_slices", recording)
  mesh = partitioning.make_mesh()
  assert mesh.shape["data"] == 8
  replicated = NamedSharding(mesh, P())
  big_rows = 8192  # float32 [8192, 256]: 8 MiB, parts of 1 MiB
  state = {"small": jax.device_put(jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32),
                                   replicated),
           "big": jax.device_put(jnp.arange(big_rows * 256, dtype=jnp.float32).reshape(
               big_rows, 256), replicated)}
  with checkpoints.Checkpointer(tmp_path, save_every_steps=1) as ckpt:
    assert ckpt.save(1, state)
    ckpt.wait_until_finished()
    assert in_parts == {(64, 32): 1, (big_rows, 256): 8}
    restored, _ = ckpt.restore(1, checkpoints.abstract_with_shardings(
        state, {"small": replicated, "big": replicated}))
  _assert_bit_exact(restored, state)
  in_parts.clear()
  with checkpoints.Checkpointer(tmp_path / "always", save_every_steps=1,
                                replica_parallel_min_slice_bytes=0) as ckpt:
    assert ckpt.save(1, state)
    ckpt.wait_until_finished()
  assert in_parts == {(64, 32): 8, (big_rows, 256): 8}  # Orbax's default
  with pytest.raises(ValueError, match="replica_parallel_min_slice_bytes"):
    checkpoints.Checkpointer(tmp_path / "bad", replica_parallel_min_slice_bytes=-1)
