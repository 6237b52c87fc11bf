"""One train step on 8 emulated devices, for several meshes, equals one device."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from openmoe_jax import partitioning
from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.model import Decoder
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
