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


def test_restore_without_checkpoint_raises(tmp_path):
  with checkpoints.Checkpointer(tmp_path) as ckpt:
    with pytest.raises(FileNotFoundError):
      ckpt.restore()
