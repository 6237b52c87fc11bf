"""Expert parallelism: what the compiled programs communicate, the emulated ragged
exchange, and the ragged all-to-all step compiled for a TPU topology.

Numerical equality of every path with one device is in test_sharded_training.py.
"""
import dataclasses
import re

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from openmoe_jax import gin_utils, partitioning, plan
from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.model import Decoder
from openmoe_jax.moe.dispatch import (AllToAllDispatcher, EinsumDispatcher,
                                      RaggedAllToAllDispatcher, SortDispatcher)
from openmoe_jax.moe.dispatch.primitives import ExpertMesh, current_expert_mesh
from openmoe_jax.moe.dispatch.ragged_all_to_all import dense_ragged_all_to_all
from openmoe_jax.objectives import CausalLm
from openmoe_jax.trainer import init_train_state, make_train_step

# Sizes chosen so that no activation has an expert weight's shape.
CFG = ModelConfig(vocab_size=64, d_model=16, num_heads=2, head_dim=8, d_ff=24,
                  num_layers=1, sparse_interval=1,
                  moe=MoeConfig(num_experts=8, group_size=16, capacity_factor_train=1.0,
                                min_capacity=1, expert_d_ff=6, residual_mlp=False))


def _compiled_step_hlo(dispatcher, degrees) -> str:
  """Returns the compiled HLO text of one train step of CFG with `dispatcher`."""
  model = Decoder(dataclasses.replace(CFG, moe=CFG.moe.replace(dispatcher=dispatcher)))
  optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
  data, fsdp, expert, tensor = degrees
  mesh = partitioning.make_mesh(data=data, fsdp=fsdp, expert=expert, tensor=tensor)
  with partitioning.activate(mesh):
    _, abstract, state_sh = init_train_state(model, optimizer, mesh,
                                             jax.random.PRNGKey(0), 16)
    batch_sh = partitioning.batch_sharding(mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract, state_sh)
    batch = {k: jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=batch_sh) for k in (
        "decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights",
        "decoder_segment_ids", "decoder_positions")}
    step = jax.jit(make_train_step(model, CausalLm(), optimizer),
                   in_shardings=(state_sh, batch_sh, partitioning.replicated(mesh)),
                   out_shardings=(state_sh, partitioning.replicated(mesh)))
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
    return step.lower(state, batch, rng).compile().as_text()


@pytest.mark.parametrize("dispatcher", [EinsumDispatcher(), SortDispatcher()],
                         ids=["einsum", "sort"])
def test_gspmd_dispatch_moves_tokens_with_all_to_alls(dispatcher):
  hlo = _compiled_step_hlo(dispatcher, (2, 1, 4, 1))
  assert plan.count_collectives(hlo)["all-to-all"] >= 2  # to the experts and back
  # Nothing of an expert weight's full shape is ever gathered (wi_0 is [8, 16, 12]
  # for OpenMoE's SwiGLU or [8, 16, 6]; wi_1 [8, 16, 6]; wo [8, 6, 16]), nor the
  # whole expert buffers [8, 8, C, 16].
  gathered = re.findall(r"= (\w+\[[\d,]*\])\S* all-gather", hlo)
  for shape in gathered:
    assert shape not in ("f32[8,16,12]", "f32[8,16,6]", "f32[8,6,16]"), gathered
    assert not shape.startswith("f32[8,8,"), gathered


def test_all_to_all_dispatcher_uses_all_to_all_inside_shard_map():
  hlo = _compiled_step_hlo(AllToAllDispatcher(), (1, 1, 8, 1))
  # Forward (to the experts, back) and the transposes in the backward pass.
  assert plan.count_collectives(hlo)["all-to-all"] >= 4


def test_expert_mesh_is_found_from_two_expert_devices_on():
  def found(num_groups, num_experts, **degrees):
    with partitioning.activate(partitioning.make_mesh(**degrees)):
      return current_expert_mesh(num_groups, num_experts)

  # The rules: experts over "expert", token groups over the batch axes and "expert",
  # expert hidden units over "tensor".
  assert found(8, 8, data=4, expert=2) == ExpertMesh(
      ("data", "expert"), ("expert",), (), 2)  # axes of one device are left out
  assert found(8, 8, data=2, expert=2, tensor=2) == ExpertMesh(
      ("data", "expert"), ("expert",), ("tensor",), 2)
  assert found(8, 8, data=1, expert=8).expert_size == 8
  assert found(8, 8, data=8) is None  # experts whole on every device
  assert found(4, 8, data=4, expert=2) is None  # 4 groups over 8 devices: no split
  assert found(12, 8, data=4, expert=2) is None  # nor 12
  with pytest.raises(ValueError, match="6 experts do not split over 4 devices"):
    found(8, 6, data=2, expert=4)


def test_dense_exchange_matches_the_ragged_all_to_all_semantics():
  # The example of jax.lax.ragged_all_to_all's docstring, on a 2-device axis.
  mesh = partitioning.make_mesh(num_devices=2)
  operand = jnp.array([[1, 2, 2], [3, 4, 0]], jnp.float32)
  output = jnp.zeros((2, 4), jnp.float32)
  input_offsets = jnp.array([[0, 1], [0, 1]], jnp.int32)
  send_sizes = jnp.array([[1, 2], [1, 1]], jnp.int32)
  output_offsets = jnp.array([[0, 0], [1, 2]], jnp.int32)
  recv_sizes = jnp.array([[1, 1], [2, 1]], jnp.int32)

  def exchange(*args):
    args = [a[0] for a in args]
    return dense_ragged_all_to_all(*args, axis_name="data")[None]

  got = jax.shard_map(exchange, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(
      operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
  np.testing.assert_array_equal(np.asarray(got), [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_dispatchers_are_gin_configurable():
  gin_utils.import_configurables()
  gin.parse_config([
      "MoeConfig.dispatcher = @RaggedAllToAllDispatcher()",
      "RaggedAllToAllDispatcher.exchange = 'dense'",
      "AllToAllDispatcher.buffer_dispatcher = @SortDispatcher()"])
  assert MoeConfig().dispatcher == RaggedAllToAllDispatcher(exchange="dense")
  assert AllToAllDispatcher() == AllToAllDispatcher(SortDispatcher())
  with pytest.raises(ValueError, match="exchange"):
    RaggedAllToAllDispatcher(exchange="bogus")


TINY_TPU = ["ModelConfig.vocab_size = 512", "ModelConfig.d_model = 128",
            "ModelConfig.num_heads = 2", "ModelConfig.head_dim = 64",
            "ModelConfig.d_ff = 256", "ModelConfig.num_layers = 2",
            "ModelConfig.sparse_interval = 2", "MoeConfig.num_experts = 8",
            "MoeConfig.group_size = 256", "make_mesh.data = 1", "make_mesh.expert = -1"]


@pytest.mark.parametrize("topology,bindings,collective", [
    # Dropless: rows go to their expert's device with the ragged collective.
    ("v5p:2x2x1", ["MoeConfig.dispatcher = @RaggedAllToAllDispatcher()",
                   "TokenChoiceRouter.dropless = True"], "ragged-all-to-all"),
    # Fixed capacity: the path for TPU v3, which has no ragged collective.
    ("v3:2x2", ["MoeConfig.dispatcher = @AllToAllDispatcher()"], "all-to-all")],
    ids=["v5p-ragged", "v3-fixed_capacity"])
def test_expert_parallel_step_compiles_for_tpu(topology, bindings, collective):
  gin_utils.import_configurables()
  gin_utils.parse_gin(["models/quickstart_moe.gin"], TINY_TPU + bindings,
                      finalize=False)
  report = plan.plan(topology, batch_size=8, sequence_length=256)
  assert report["fits"] and report["mesh"]["expert"] == report["num_devices"]
  # Two exchanges forward (to the experts and back), two in the backward pass.
  assert report["collectives"][collective] >= 4
