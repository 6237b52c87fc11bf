"""Ahead-of-time TPU compiles on this CPU host (libtpu + jax.experimental.topologies).

For each of v3, v4, v5e, v5p and v6e: the grouped matmul, permute and combine
kernels compile forward and backward on one device, and so does one jitted train
step of a MoE block with the default dispatcher, which must pick the Pallas ragged
path (value_and_grad + SGD), data-parallel over all the topology's devices (the
kernels under shard_map). The compiled HLO
must hold the Mosaic custom calls, so a silent fallback to XLA (or interpret mode)
fails the test.
"""
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from openmoe_jax import partitioning
from openmoe_jax.config import MoeConfig
from openmoe_jax.kernels import permute
from openmoe_jax.kernels.pallas_gmm import pallas_gmm
from openmoe_jax.kernels.target import compile_target
from openmoe_jax.moe.layer import MoeLayer
from openmoe_jax.plan import topology_devices

pytest.importorskip("libtpu")

TOPOLOGIES = ["v3:2x2", "v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"]
MOSAIC = "tpu_custom_call"
COMPILE_SECONDS = {}


@pytest.fixture(scope="module", params=TOPOLOGIES)
def devices(request):
  """Yields the TPU devices of the topology; reports the compile time."""
  devs = topology_devices(request.param)
  start = time.perf_counter()
  yield devs
  COMPILE_SECONDS[request.param] = time.perf_counter() - start
  print(f"\n{request.param}: TPU compiles took {COMPILE_SECONDS[request.param]:.1f}s")


def _spec(device, shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype,
                              sharding=jax.sharding.SingleDeviceSharding(device))


def _compile(device, fn, *args) -> str:
  """Returns the compiled HLO text of jit(fn) for the device's TPU generation."""
  with compile_target(device):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_bf16_kernels_compile_forward_and_backward(devices):
  _check_kernels_compile(devices[0], jnp.bfloat16)


# float32 kernels: one generation with an f32-only MXU path (v3) and one without
# (v5e) are enough to cover the f32 layouts; every generation compiles bf16 above.
@pytest.mark.parametrize("topology", ["v3:2x2", "v5e:2x2"])
def test_f32_kernels_compile_forward_and_backward(topology):
  _check_kernels_compile(topology_devices(topology)[0], jnp.float32)


def _check_kernels_compile(device, dtype):
  """Compiles gmm, permute and combine forward+backward for `device`'s generation."""
  n, d, f, num_experts, k = 256, 256, 512, 4, 2

  def gmm_loss(lhs, rhs, sizes):
    return jnp.sum(pallas_gmm(lhs, rhs, sizes).astype(jnp.float32))

  hlo = _compile(device, jax.value_and_grad(gmm_loss, (0, 1)),
                 _spec(device, (n, d), dtype),
                 _spec(device, (num_experts, d, f), dtype),
                 _spec(device, (num_experts,), jnp.int32))
  assert hlo.count(MOSAIC) >= 3  # gmm, lhs-grad gmm, rhs-grad tgmm

  def permute_loss(x, y, gates, src_r, row_nk):
    rows = permute.permute(x, src_r, row_nk)
    out = permute.combine(y, row_nk, gates, src_r)
    return jnp.sum(rows.astype(jnp.float32)) + jnp.sum(out.astype(jnp.float32))

  hlo = _compile(device, jax.value_and_grad(permute_loss, (0, 1, 2)),
                 _spec(device, (n, d), dtype), _spec(device, (n * k, d), dtype),
                 _spec(device, (n, k), jnp.float32),
                 _spec(device, (n * k,), jnp.int32), _spec(device, (n, k), jnp.int32))
  assert hlo.count(MOSAIC) >= 5  # permute + its grad, combine + 2 for its grads


def test_moe_block_train_step_compiles(devices):
  mesh = Mesh(np.array(devices), ("data",))
  # The default AutoDispatcher picks RaggedDispatcher(backend="pallas") on TPU.
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=128)
  layer = MoeLayer(cfg, "swiglu", 256, dtype=jnp.bfloat16)
  x_shape = (len(devices), 128, 128)  # one group of 128 tokens per device
  params = jax.eval_shape(
      lambda x: nn.unbox(layer.init(jax.random.PRNGKey(0), x, train=False)),
      jax.ShapeDtypeStruct(x_shape, jnp.bfloat16))
  spec = lambda shape, dtype, *axes: jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*axes)))
  param_specs = jax.tree.map(lambda p: spec(p.shape, p.dtype), params)

  def train_step(params, x_btd):
    def loss_fn(params):
      y_btd, aux = layer.apply(params, x_btd, train=True)
      return jnp.mean(jnp.square(y_btd.astype(jnp.float32))) + aux["lb_loss"]
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

  with partitioning.activate(mesh):
    hlo = _compile(devices[0], train_step, param_specs,
                   spec(x_shape, jnp.bfloat16, "data"))
  # forward: permute, 3 gmm, combine (5); backward: combine's 2 gathers, the down
  # projection's 2 kernels, the up projections' rhs grads (the grads w.r.t. the
  # permuted input x are dead: x is data) (6)
  assert hlo.count(MOSAIC) >= 11
  assert "all-gather" not in hlo  # tokens stay on their device
