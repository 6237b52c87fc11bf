"""Pallas kernels in interpret mode against their references, forward and gradients.

Grouped matmul == jax.lax.ragged_dot; permute / combine == their XLA gathers (and
the v3 "split" row layout == the default one); RaggedDispatcher(backend="pallas")
== RaggedDispatcher(backend="padded") on a small routing, and inside a MoE layer on
a 2-device mesh (the per-device shard_map path, token groups split or whole).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from openmoe_jax import partitioning
from openmoe_jax.config import MoeConfig
from openmoe_jax.kernels import permute, permute_pallas
from openmoe_jax.kernels.pallas_gmm import choose_tiling, pallas_gmm
from openmoe_jax.kernels.target import compile_target, on_tpu, tpu_generation
from openmoe_jax.moe.dispatch import ExpertWeights, RaggedDispatcher
from openmoe_jax.moe.dispatch.primitives import group_spec
from openmoe_jax.moe.layer import MoeLayer
from openmoe_jax.moe.routers import top_k_capacity_routing

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5),
       jnp.bfloat16: dict(rtol=2e-2, atol=5e-2)}
GROUPS = {  # n = 40 rows; tm = 48 pads m, groups straddle tiles (all-empty groups:
    # tests/test_grouped_matmul.py)
    "ragged_empty": [0, 7, 13, 0, 20],
    "rows_past_groups": [5, 0, 11, 1, 4],
}


def _close(got, want, dtype):
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             **TOL[dtype])


def _vjp(fn, *args):
  """Returns jitted (out, grads of sum(out * ct)) with a fixed random cotangent."""
  def run(*args):
    out, pull = jax.vjp(fn, *args)
    ct = jax.random.normal(jax.random.PRNGKey(9), out.shape, jnp.float32)
    return out, pull(ct.astype(out.dtype))
  return jax.jit(run)(*args)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_gmm_matches_ragged_dot(groups, dtype):
  sizes = jnp.array(GROUPS[groups], jnp.int32)
  n, d, f = 40, 24, 136  # k, n padded to 128 / 256 lanes inside
  kl, kr = jax.random.split(jax.random.PRNGKey(len(groups)))
  lhs = jax.random.normal(kl, (n, d), jnp.float32).astype(dtype)
  rhs = jax.random.normal(kr, (5, d, f), jnp.float32).astype(dtype)
  gmm = lambda a, b: pallas_gmm(a, b, sizes, tiling=(48, 128, 128), interpret=True)
  ref = lambda a, b: jax.lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32),
                                        sizes).astype(dtype)
  out, (dlhs, drhs) = _vjp(gmm, lhs, rhs)
  want, (want_dlhs, want_drhs) = _vjp(ref, lhs, rhs)
  assert out.dtype == dtype and dlhs.dtype == dtype and drhs.dtype == dtype
  _close(out, want, dtype)
  assert not np.any(np.asarray(out[int(sizes.sum()):], np.float32))  # rows past = 0
  _close(dlhs, want_dlhs, dtype)
  _close(drhs, want_drhs, dtype)


def test_gmm_upcast_path_and_default_tiling():
  sizes = jnp.array([3, 0, 9], jnp.int32)
  lhs = jax.random.normal(jax.random.PRNGKey(0), (12, 16)).astype(jnp.bfloat16)
  rhs = jax.random.normal(jax.random.PRNGKey(1), (3, 16, 8)).astype(jnp.bfloat16)
  got = pallas_gmm(lhs, rhs, sizes, interpret=True, upcast=True)  # the v3 path
  assert got.dtype == jnp.bfloat16
  _close(got, jax.lax.ragged_dot(lhs, rhs, sizes), jnp.bfloat16)


def test_choose_tiling():
  assert choose_tiling(40, 24, 136, 5) == (48, 128, 256)
  assert choose_tiling(4096, 768, 2048, 16) == (256, 256, 512)
  assert choose_tiling(32768, 512, 256, 256) == (128, 512, 256)
  assert choose_tiling(65536, 1024, 4096, 8) == (512, 512, 512)


def test_compile_target_overrides_the_device():
  attached = on_tpu()
  assert attached == (jax.devices()[0].platform == "tpu")
  with compile_target("TPU v3"):
    assert on_tpu() and tpu_generation() == 3
    with compile_target("cpu"):
      assert not on_tpu() and tpu_generation() is None
  with compile_target("TPU v5 lite"):
    assert tpu_generation() == 5
  assert on_tpu() == attached


def _dispatch_maps(n: int, k: int, num_rows: int, seed: int):
  """Returns inverse maps (src_r [R], row_nk [n, k]) of a random partial dispatch."""
  rng = np.random.default_rng(seed)
  row_nk = np.full((n, k), -1, np.int32)
  src_r = np.full((num_rows,), -1, np.int32)
  free = list(rng.permutation(num_rows))
  for t in range(n):
    for j in range(k):
      if rng.random() < 0.75 and free:
        row_nk[t, j] = free.pop()
        src_r[row_nk[t, j]] = t
  return jnp.asarray(src_r), jnp.asarray(row_nk)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_permute_and_combine_match_xla(dtype):
  n, k, num_rows, d = 21, 3, 50, 72
  src_r, row_nk = _dispatch_maps(n, k, num_rows, seed=1)
  kx, ky, kg = jax.random.split(jax.random.PRNGKey(2), 3)
  x = jax.random.normal(kx, (n, d)).astype(dtype)
  y = jax.random.normal(ky, (num_rows, d)).astype(dtype)
  gates = jax.random.uniform(kg, (n, k))
  for interpret in (True, False):  # False off TPU: the XLA fallback
    got = _vjp(lambda a: permute.permute(a, src_r, row_nk, interpret), x)
    comb = _vjp(lambda a, g: permute.combine(a, row_nk, g, src_r, interpret), y, gates)
    if interpret:
      pallas_perm, pallas_comb = got, comb
  out, (dx,) = pallas_perm
  _close(out, got[0], dtype)
  assert not np.any(np.asarray(out[np.asarray(src_r) < 0], np.float32))
  _close(dx, got[1][0], dtype)
  out, (dy, dgates) = pallas_comb
  assert out.dtype == dtype and dgates.dtype == jnp.float32
  _close(out, comb[0], dtype)
  _close(dy, comb[1][0], dtype)
  _close(dgates, comb[1][1], dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_split_layout_matches(dtype):
  """The TPU v3 layout (rows in 256-lane pieces) gathers and combines the same."""
  n, k, num_rows, d = 9, 2, 20, 40
  src_r, row_nk = _dispatch_maps(n, k, num_rows, seed=3)
  x = jax.random.normal(jax.random.PRNGKey(4), (num_rows, d)).astype(dtype)
  gates = jax.random.uniform(jax.random.PRNGKey(5), (n, k))
  gather = jax.jit(lambda x: permute_pallas.gather_rows(x, src_r, True, split=True))
  _close(gather(x[:n]), permute.gather_rows_xla(x[:n], src_r), dtype)
  combine = jax.jit(lambda x: permute_pallas.combine_rows(x, row_nk, gates, True,
                                                          split=True))
  got = combine(x)
  _close(got, permute.combine_xla(x, row_nk, gates), dtype)


def test_ragged_pallas_matches_padded():
  g, s, d, num_experts, k, capacity = 2, 12, 16, 4, 2, 4  # overflow: drops, empty rows
  kx, kp, kw = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (g, s, d))
  probs = jax.nn.softmax(jax.random.normal(kp, (g, s, num_experts)), axis=-1)
  routing = top_k_capacity_routing(probs, k, capacity)
  w0, w1, w2 = jax.random.normal(kw, (3, num_experts, d, d)) / 4
  weights = ExpertWeights(wi_0=w0, wi_1=w1, wo=w2, kind="swiglu")

  def run(dispatcher):
    def loss(x, weights, gates):
      r = routing.replace(gates=gates)
      y = dispatcher(x, r, weights)
      return jnp.sum(y * jnp.cos(y)), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        x, weights, routing.gates)

  (_, y), grads = run(RaggedDispatcher("pallas", interpret=True))
  (_, y_ref), grads_ref = run(RaggedDispatcher("padded", tile=4))
  _close(y, y_ref, jnp.float32)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    _close(got, want, jnp.float32)


def _two_device_mesh():
  return jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("batch", [2, 1], ids=["groups_split", "one_group"])
def test_ragged_pallas_under_a_mesh_matches_padded(batch):
  """On a multi-device mesh the Pallas path runs per device under shard_map: two
  token groups split over the two devices; one group (the one-sequence batch of
  initialisation) does not split and goes whole to each device."""
  layer = lambda dispatcher: MoeLayer(
      MoeConfig(num_experts=4, top_k=2, group_size=8, dispatcher=dispatcher),
      "swiglu", 16)
  x = jax.random.normal(jax.random.PRNGKey(0), (batch, 8, 8))
  params = nn.unbox(jax.jit(lambda x: layer(RaggedDispatcher("padded")).init(
      jax.random.PRNGKey(1), x, train=False))(x))

  def lowered(dispatcher):
    def loss(params, x):
      y, aux = layer(dispatcher).apply(params, x, train=True)
      return jnp.sum(y * jnp.cos(y)) + aux["lb_loss"], y
    return jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params, x)

  mesh = _two_device_mesh()
  with partitioning.activate(mesh):
    program = lowered(RaggedDispatcher("pallas", interpret=True))
  assert "manual" in program.as_text().lower()  # the shard_map region
  (_, y), grads = program.compile()(params, x)
  (_, y_ref), grads_ref = lowered(RaggedDispatcher("padded", tile=4)).compile()(
      params, x)
  _close(y, y_ref, jnp.float32)
  jax.tree.map(lambda a, b: _close(a, b, jnp.float32), grads, grads_ref)


def test_token_groups_split_over_the_batch_axes_only_when_they_divide():
  mesh = _two_device_mesh()
  split = partitioning.logical_spec(mesh.axis_names, "expert_group")
  assert split == PartitionSpec("data")
  assert [group_spec(mesh, g) for g in (1, 2, 3, 4)] == [
      PartitionSpec(), split, PartitionSpec(), split]


def test_the_row_kernels_refuse_rows_they_cannot_move_by_name():
  rows = jnp.zeros((4, 8), jnp.int8)
  with pytest.raises(ValueError, match="permute kernels take 16- or 32-bit rows, got int8"):
    permute_pallas.gather_rows(rows, jnp.arange(4), interpret=True)
  with pytest.raises(ValueError, match="combine kernel takes float32 or bfloat16 rows, "
                     "got float16"):
    permute_pallas.combine_rows(jnp.zeros((4, 8), jnp.float16), jnp.zeros((2, 2), jnp.int32),
                                jnp.ones((2, 2)), interpret=True)
