"""AutoDispatcher: which engine it picks per platform and size, and that it is that
engine exactly."""
import jax
import numpy as np

from openmoe_jax import partitioning
from openmoe_jax.config import MoeConfig
from openmoe_jax.kernels.target import compile_target
from openmoe_jax.moe.dispatch import (AllToAllDispatcher, AutoDispatcher,
                                      BlockDispatcher, EinsumDispatcher, ExpertWeights,
                                      RaggedAllToAllDispatcher,
                                      RaggedDispatcher, SortDispatcher)
from openmoe_jax.moe.dispatch.primitives import auto_tile
from openmoe_jax.moe.layer import dispatcher_of
from openmoe_jax.moe.routers import expert_capacity, top_k_capacity_routing


def _expert_mesh():
  """4 devices: token groups split over 'data' (2), experts over 'expert' (2)."""
  return jax.make_mesh((2, 2), ("data", "expert"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_moe_config_defaults_to_auto():
  assert MoeConfig().dispatcher is None
  assert isinstance(dispatcher_of(MoeConfig()), AutoDispatcher)


def test_choice_per_platform_and_size():
  auto = AutoDispatcher()
  # The quickstart's MoE layer (groups of 256, E 8, capacity factor 1.25 / 2.0).
  for cf in (1.25, 2.0):
    assert auto.choose(256, 8, expert_capacity(256, 8, cf, 4), 2) == EinsumDispatcher()
  base_capacity = expert_capacity(4096, 16, 1.25, 4)  # OpenMoE-Base's layer
  assert auto.choose(4096, 16, base_capacity, 2) == BlockDispatcher()  # 512 per expert
  # E above the einsum limit: block from 256 choices per expert (over all groups).
  assert auto.choose(8192, 64, 320, 2) == BlockDispatcher()  # 256 per expert
  assert auto.choose(4096, 64, 160, 2) == SortDispatcher()  # 128 per expert
  assert auto.choose(2048, 64, 80, 2, num_groups=4) == BlockDispatcher()
  assert auto.choose(2048, 64, 80, 2, num_groups=2) == SortDispatcher()
  assert auto.choose(4096, 256, 160, 8) == SortDispatcher()  # OpenMoE 2's fine experts
  assert auto.choose(8192, 256, 320, 8) == BlockDispatcher()
  assert auto.choose(4096, 256, 40, 2) == SortDispatcher()
  assert auto.choose(4096, 64, 4096, 2) == BlockDispatcher()  # dropless
  assert auto.choose(1024, 256, 1024, 2) == BlockDispatcher()  # dropless, 8 per expert
  for kind in ("TPU v3", "TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite"):
    with compile_target(kind):
      assert auto.choose(256, 8, 40, 2) == RaggedDispatcher("pallas")
  assert AutoDispatcher(einsum_max_elements=0).choose(256, 8, 40, 2) == SortDispatcher()
  expert_mesh = _expert_mesh()
  data_mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4],
                            axis_types=(jax.sharding.AxisType.Auto,))
  # CPU, experts split over devices (GSPMD): the buffers that carry the sharding.
  with partitioning.activate(expert_mesh):
    assert auto.choose(1024, 64, 40, 2) == SortDispatcher()
    assert auto.choose(4096, 64, 4096, 2) == RaggedDispatcher("padded")
  with partitioning.activate(data_mesh):
    assert auto.choose(8192, 64, 320, 2) == BlockDispatcher()
  with compile_target("TPU v5p"):
    with partitioning.activate(expert_mesh):
      assert auto.choose(256, 8, 40, 2) == AllToAllDispatcher(buffer_dispatcher=SortDispatcher())
      # Dropless (capacity = the group): exact-size ragged exchange.
      assert auto.choose(256, 8, 256, 2) == RaggedAllToAllDispatcher(backend="pallas")
    with partitioning.activate(data_mesh):
      assert auto.choose(256, 8, 40, 2) == RaggedDispatcher("pallas")
  with compile_target("TPU v3"), partitioning.activate(expert_mesh):
    # v3 has no ragged_all_to_all: fixed-capacity all_to_all over sorted buffers.
    assert auto.choose(256, 8, 256, 2) == AllToAllDispatcher(buffer_dispatcher=SortDispatcher())


def test_cpu_limits_are_inclusive():
  """einsum up to 16 experts and s x E x C = 2^20 elements, both included; dropless
  (block) only when E x C exceeds twice the s x k choices."""
  auto = AutoDispatcher()
  assert auto.choose(256, 16, 40, 2) == EinsumDispatcher()
  assert auto.choose(256, 17, 40, 2) == SortDispatcher()
  assert auto.choose(1024, 16, 64, 2) == EinsumDispatcher()  # 1024 x 16 x 64 = 2^20
  assert auto.choose(1024, 16, 65, 2) == SortDispatcher()
  assert auto.choose(1024, 64, 64, 2) == SortDispatcher()  # E C = 2 s k: capacity
  assert auto.choose(1024, 64, 65, 2) == BlockDispatcher()  # dropless


def test_the_call_passes_the_routing_shapes_to_choose(monkeypatch):
  seen = []
  monkeypatch.setattr(AutoDispatcher, "choose",
                      lambda self, *args: seen.append(args) or SortDispatcher())
  g, s, d, num_experts, k, capacity = 3, 8, 4, 5, 2, 6
  probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(1), (g, s, num_experts)))
  w = jax.numpy.ones((num_experts, d, d))
  AutoDispatcher()(jax.numpy.ones((g, s, d)), top_k_capacity_routing(probs, k, capacity),
                   ExpertWeights(wi_0=w, wi_1=w, wo=w, kind="swiglu"))
  assert seen == [(s, num_experts, capacity, k, g)]


def test_gpu_picks_sort_for_capacity_and_ragged_dot_for_dropless(monkeypatch):
  """The fastest of each kind on an H200 (module docstring): sort for capacity
  routing, even where the CPU picks einsum or block; lax.ragged_dot for dropless."""
  auto = AutoDispatcher()
  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"):
    with compile_target(kind):
      # Small E (einsum on CPU) and many rows per expert (block on CPU).
      for args in [(256, 8, 40, 2), (4096, 16, 640, 2), (4096, 64, 160, 2)]:
        assert auto.choose(*args) == SortDispatcher(), (kind, args)
      # Dropless: E x C over twice the s x k choices.
      assert auto.choose(4096, 64, 4096, 2) == RaggedDispatcher("ragged_dot"), kind
  # A faked GPU backend (no compile target) picks the same.
  # So does a GPU whose device_kind names no vendor (e.g. an older "Quadro").
  for kind in ("NVIDIA H200", "Quadro RTX 8000"):
    gpu = type("FakeGpu", (), {"platform": "gpu", "device_kind": kind})()
    with monkeypatch.context() as m:
      m.setattr(jax, "devices", lambda *a: [gpu])
      assert auto.choose(256, 8, 40, 2) == SortDispatcher(), kind
      assert auto.choose(256, 8, 256, 2) == RaggedDispatcher("ragged_dot"), kind
  assert auto.choose(256, 8, 40, 2) == EinsumDispatcher()  # back on the CPU
  # Experts split over devices: the GPU keeps the capacity / padded rules.
  expert_mesh = _expert_mesh()
  with compile_target("NVIDIA H100 80GB HBM3"), partitioning.activate(expert_mesh):
    assert auto.choose(1024, 64, 40, 2) == SortDispatcher()


def test_output_is_the_chosen_engines():
  g, s, d, num_experts = 2, 16, 8, 4
  x = jax.random.normal(jax.random.PRNGKey(0), (g, s, d))
  probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(1), (g, s, num_experts)))
  routing = top_k_capacity_routing(probs, 2, 5)  # overflow: some choices dropped
  w0, w1, w2 = jax.random.normal(jax.random.PRNGKey(2), (3, num_experts, d, d))
  weights = ExpertWeights(wi_0=w0, wi_1=w1, wo=w2, kind="swiglu")
  for auto, engine in [(AutoDispatcher(), EinsumDispatcher()),
                       (AutoDispatcher(einsum_max_elements=0), SortDispatcher()),
                       (AutoDispatcher(einsum_max_elements=0, block_min_rows=1),
                        BlockDispatcher())]:
    got = jax.jit(lambda x: auto(x, routing, weights))(x)
    want = jax.jit(lambda x: engine(x, routing, weights))(x)
    np.testing.assert_array_equal(got, want)


def test_tpu_v4_is_the_first_generation_with_the_ragged_exchange():
  """Dropless routing with experts split over devices: v4 and later exchange exact
  row counts (ragged_all_to_all), v3 keeps the fixed-capacity all_to_all."""
  auto = AutoDispatcher()
  expert_mesh = _expert_mesh()
  for kind in ("TPU v4", "TPU v5 lite", "TPU v6 lite"):
    with compile_target(kind), partitioning.activate(expert_mesh):
      assert auto.choose(256, 8, 256, 2) == RaggedAllToAllDispatcher(
          backend="pallas"), kind
  with compile_target("TPU v3"), partitioning.activate(expert_mesh):
    assert auto.choose(256, 8, 256, 2) == AllToAllDispatcher(
        buffer_dispatcher=SortDispatcher())


def test_auto_tile_is_the_mean_group_size_rounded_down_to_a_power_of_two():
  """Padded grouped-matmul tile: mean rows per expert rounded down to a power of two,
  clipped to [8, 128] (a larger tile only pads more)."""
  assert auto_tile(1000, 8) == 64  # mean 125
  assert auto_tile(512, 8) == 64  # mean 64 exactly
  assert auto_tile(8 * 33, 8) == 32
  assert auto_tile(10, 8) == 8 and auto_tile(0, 8) == 8
  assert auto_tile(10 ** 6, 8) == 128
