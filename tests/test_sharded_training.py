"""One train step on 8 emulated devices, for several meshes, equals one device:
for the einsum dispatcher (the full check, with parameter placement), and for every
expert-parallel path that runs on CPU with token- and expert-choice routers."""
import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from openmoe_jax import partitioning
from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.model import Decoder
from openmoe_jax.moe.dispatch import (AllToAllDispatcher, EinsumDispatcher,
                                      RaggedAllToAllDispatcher, SortDispatcher)
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter
from openmoe_jax.objectives import CausalLm
from openmoe_jax.trainer import init_train_state, make_train_step

CFG = ModelConfig(vocab_size=64, d_model=16, num_heads=2, head_dim=8, d_ff=24,
                  num_layers=2, sparse_interval=2,
                  moe=MoeConfig(num_experts=8, group_size=16, capacity_factor_train=1.0,
                                min_capacity=1, expert_d_ff=8))
MESHES = [(8, 1, 1, 1), (2, 1, 4, 1), (1, 2, 4, 1), (2, 2, 2, 1), (1, 1, 8, 1),
          (2, 1, 2, 2)]


def _batch(b=8, t=16):
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, CFG.vocab_size, size=(b, t)).astype(np.int32)
  return {"decoder_input_tokens": tokens, "decoder_target_tokens": np.roll(tokens, -1, 1),
          "decoder_loss_weights": np.ones((b, t), np.int32),
          "decoder_segment_ids": np.ones((b, t), np.int32),
          "decoder_positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))}


def _one_step(mesh):
  model = Decoder(CFG)
  # SGD: the parameter change is the gradient itself (Adam would amplify float
  # reordering noise in near-zero gradients).
  optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
  with partitioning.activate(mesh):
    init, _, state_sh = init_train_state(model, optimizer, mesh, jax.random.PRNGKey(0), 16)
    state = init(jax.random.PRNGKey(0))
    batch_sh = partitioning.batch_sharding(mesh)
    batch = jax.tree.map(lambda a: jax.device_put(a, batch_sh), _batch())
    step = jax.jit(make_train_step(model, CausalLm(), optimizer),
                   in_shardings=(state_sh, batch_sh, partitioning.replicated(mesh)),
                   out_shardings=(state_sh, partitioning.replicated(mesh)))
    new_state, metrics = step(state, batch, jax.random.PRNGKey(1))
  return state, new_state, metrics


@pytest.fixture(scope="module")
def single_device():
  return _one_step(partitioning.make_mesh(num_devices=1))


@pytest.mark.parametrize("degrees", MESHES, ids=lambda d: "x".join(map(str, d)))
def test_train_step_matches_single_device(degrees, single_device):
  data, fsdp, expert, tensor = degrees
  mesh = partitioning.make_mesh(data=data, fsdp=fsdp, expert=expert, tensor=tensor)
  state, new_state, metrics = _one_step(mesh)
  _, expected_state, expected = single_device
  for key in ("loss", "ce_loss", "grad_norm", "moe/drop_fraction"):
    assert float(metrics[key]) == pytest.approx(float(expected[key]), rel=1e-5, abs=1e-7)
  for got, want in zip(jax.tree.leaves(new_state.params),
                       jax.tree.leaves(expected_state.params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
  # Parameters live where the logical rules say.
  experts = state.params["layers_0"]["block_1"]["moe"]["experts"]["wi_0"]
  spec = experts.sharding.spec  # [layers, expert, embed, expert_mlp]
  assert spec[1] == ("expert" if expert > 1 else None)
  assert spec[2] == ("fsdp" if fsdp > 1 else None)
  assert spec[3] == ("tensor" if tensor > 1 else None)
  if expert > 1:
    assert experts.addressable_shards[0].data.shape[1] == CFG.moe.num_experts // expert
  query = state.params["layers_0"]["block_0"]["attention"]["query"]
  assert query.sharding.spec[3 - 1] == ("tensor" if tensor > 1 else None)


def test_mesh_degree_errors():
  with pytest.raises(ValueError, match="at most one -1"):
    partitioning.make_mesh(data=-1, expert=-1)
  with pytest.raises(ValueError, match="multiply"):
    partitioning.make_mesh(data=2, expert=2)
  mesh = partitioning.make_mesh(expert=4)
  assert dict(mesh.shape) == {"data": 2, "expert": 4}
  assert partitioning.batch_sharding(mesh).spec == P(("data", "expert"))


# Expert-parallel paths: a one-layer (MoE) model keeps each compile small. Every path
# serves the same kept choices, so all are compared with one einsum baseline.
EP_CFG = dataclasses.replace(CFG, num_layers=1, sparse_interval=1,
                             moe=CFG.moe.replace(residual_mlp=False))
PATHS = {
    "einsum": EinsumDispatcher(),  # GSPMD, constrained to all-to-alls
    "sort": SortDispatcher(),  # GSPMD
    "all_to_all": AllToAllDispatcher(),  # shard_map + lax.all_to_all
    "all_to_all_sort": AllToAllDispatcher(SortDispatcher()),
    # shard_map + the ragged exchange (emulated with a dense all-to-all on CPU).
    "ragged_all_to_all": RaggedAllToAllDispatcher(exchange="dense"),
    # The same with the padded grouped matmul, under shard_map's check_vma=False.
    "ragged_all_to_all_padded": RaggedAllToAllDispatcher(backend="padded",
                                                         exchange="dense"),
}
ROUTERS = {"token_choice": TokenChoiceRouter(), "expert_choice": ExpertChoiceRouter()}
# Each path on every mesh; routers alternate over meshes and paths, so every path
# meets both routers (3 meshes each) and every mesh meets both routers. Einsum with
# token choice is the test above; the variants (sorted buffers for all_to_all, the
# padded grouped matmul for ragged_all_to_all) run on the mesh with every axis kind.
EP_CASES = [(degrees, path, router)
            for i, degrees in enumerate(MESHES)
            for j, path in enumerate(("einsum", "sort", "all_to_all", "ragged_all_to_all"))
            for router in [("token_choice", "expert_choice")[(i + j) % 2]
                           if path != "einsum" else "expert_choice"]]
EP_CASES += [((2, 1, 2, 2), "all_to_all_sort", "token_choice"),
             ((2, 1, 2, 2), "ragged_all_to_all_padded", "expert_choice")]


@functools.lru_cache(maxsize=None)
def _ep_initial_state(router: str):
  """Returns the initial state (host arrays) of the EP model; same for every path."""
  model = Decoder(_ep_config("einsum", router))
  mesh = partitioning.make_mesh(num_devices=1)
  with partitioning.activate(mesh):
    init, _, _ = init_train_state(model, _sgd(), mesh, jax.random.PRNGKey(0), 16)
    return jax.device_get(init(jax.random.PRNGKey(0)))


def _sgd():
  return optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)


def _ep_config(path: str, router: str) -> ModelConfig:
  return dataclasses.replace(EP_CFG, moe=EP_CFG.moe.replace(
      dispatcher=PATHS[path], router=ROUTERS[router]))


def _ep_step(mesh, path: str, router: str):
  """Returns (new state, metrics) of one train step of the EP model on `mesh`."""
  model = Decoder(_ep_config(path, router))
  with partitioning.activate(mesh):
    _, _, state_sh = init_train_state(model, _sgd(), mesh, jax.random.PRNGKey(0), 16)
    state = jax.device_put(_ep_initial_state(router), state_sh)
    batch_sh = partitioning.batch_sharding(mesh)
    batch = jax.tree.map(lambda a: jax.device_put(a, batch_sh), _batch())
    step = jax.jit(make_train_step(model, CausalLm(), _sgd()),
                   in_shardings=(state_sh, batch_sh, partitioning.replicated(mesh)),
                   out_shardings=(state_sh, partitioning.replicated(mesh)))
    return step(state, batch, jax.random.PRNGKey(1))


@pytest.fixture(scope="module")
def ep_single_device():
  """Single-device einsum results per router."""
  mesh = partitioning.make_mesh(num_devices=1)
  return {router: _ep_step(mesh, "einsum", router) for router in ROUTERS}


@pytest.mark.parametrize("degrees,path,router", EP_CASES, ids=[
    f"{'x'.join(map(str, d))}-{p}-{r}" for d, p, r in EP_CASES])
def test_expert_parallel_paths_match_single_device(degrees, path, router,
                                                   ep_single_device):
  data, fsdp, expert, tensor = degrees
  mesh = partitioning.make_mesh(data=data, fsdp=fsdp, expert=expert, tensor=tensor)
  new_state, metrics = _ep_step(mesh, path, router)
  expected_state, expected = ep_single_device[router]
  for key in ("loss", "ce_loss", "grad_norm", "moe/drop_fraction"):
    assert float(metrics[key]) == pytest.approx(float(expected[key]), rel=1e-5, abs=1e-7)
  for got, want in zip(jax.tree.leaves(new_state.params),
                       jax.tree.leaves(expected_state.params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
