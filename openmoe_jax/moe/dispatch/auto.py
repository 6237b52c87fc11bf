"""The default dispatcher: picks a dispatch engine per platform and size at trace time.

- TPU (the attached device, or `kernels.target.compile_target` for ahead-of-time
  compiles): `RaggedDispatcher(backend="pallas")`, the Pallas grouped matmul and
  permute kernels (per device under shard_map on a mesh), unless the current mesh
  splits the experts over devices (expert parallelism; the ragged path would gather
  every expert's weights onto every device): then
  `AllToAllDispatcher(buffer_dispatcher=SortDispatcher())` (fixed-capacity
  all_to_all of the [E, g, C, d] buffers) for capacity-limited routing, and for dropless routing (the
  buffers would dwarf the choices, as below) on v4 and later
  `RaggedAllToAllDispatcher(backend="pallas")`, which exchanges exactly the routed
  rows (v3 has no ragged_all_to_all and keeps the all_to_all).
- GPU (device 0's platform is "gpu", or a compile target whose device_kind names an
  NVIDIA/AMD GPU), experts not split over devices: `SortDispatcher` for capacity
  routing, `RaggedDispatcher("ragged_dot")` (jax's `lax.ragged_dot`) for dropless
  routing; with experts split over devices GPU follows the rules below. Measured on
  one H200 (benchmarks/accelerator.py, jax 0.11.2, bf16 fwd+bwd, 4096 tokens,
  capacity factor 1.25; README, docs/benchmarks/accelerator_h200.json): sort took
  0.95 / 0.50 / 1.26 ms at (E 16, k 2) / (E 64, k 2) / (E 256, k 8), einsum 1.38 /
  0.78 / 2.23, and `lax.ragged_dot`, which XLA did not lower to one fast grouped
  matmul there, 6.9 / 6.2 / 61; in a 1.08B MoE's train step sort took 129 ms,
  einsum 140, block 216 and ragged_dot 270. The dropless paths were all slow
  (ragged_dot as above, block 8.5 / 16.5 / 65 ms, padded ragged 17.9 / 20.0 / 78),
  ragged_dot the least slow.
- Elsewhere (CPU): `EinsumDispatcher` while the one-hot dispatch tensor is small (at most
  `einsum_max_experts` experts and s x E x C <= `einsum_max_elements` per group);
  else `BlockDispatcher` for dropless routing (C up to s: E x C over
  `ragged_buffer_ratio` x the s x k choices) and for capacity routing with at least
  `block_min_rows` choices per expert on average (g s k / E), `SortDispatcher` for
  capacity routing with fewer. When a mesh splits the experts over devices (GSPMD
  expert parallelism, e.g. the emulated meshes of the tests): `SortDispatcher`, whose
  buffers carry the expert sharding, or `RaggedDispatcher(backend="padded")` for
  dropless routing.

Why those thresholds (benchmarks/moe_layer.py, fwd+bwd on a 2-core CPU, capacity
factor 1.25 per choice): the one-hot einsums cost O(s E C d) and pay off only while
that tensor is small. Sort took 0.56x einsum's time at 1024 tokens, E 8 (s E C =
2.6M), 0.41x at 1024 tokens, E 16 (2.6M), 0.52x at 4096 tokens, E 16 (42M) and about
1/6 at E 64 and 256; at 512 tokens, E 16 (0.65M) einsum was faster (158 vs 188 ms),
and at the quickstart's 256 tokens, E 8 (0.16M) the two were within the noise (in
the quickstart's whole train step sort was 2.6% faster, and runs/quickstart.gin
picks it). The block path computes only the kept choices (no empty capacity
slots) in row chunks (`block.chunk_rows`; these numbers with 128 rows): at 4096
tokens it took
0.95x / 0.95x / 0.82x of sort's time at (E 16, k 2) / (E 64, k 2) / (E 256, k 8)
(512, 128 and 128 choices per expert) and 0.88x / 0.72x / 0.62x of the padded
ragged path's for dropless routing; with 32 or 64 choices per expert its chunks are
small and each expert's weights are copied and its gradient written for few rows,
so sort was faster (1024 tokens, E 64: 173 vs 206 ms; 2048 tokens, E 64: 247 vs 276;
4096 tokens, E 128 and E 256, k 2: 549 vs 559 and 741 vs 1196), while for dropless
routing block stayed ahead of the padded ragged path (README, `--sweep`).
`block_min_rows` is 256, not 128, since the same `--sweep` on a second 2-core
machine (Intel Xeon with AVX-512, where the dense MLP runs faster: 133 against 214
ms at 4096 tokens, d 512) put sort ahead of block up to 256 rows per expert (E 64:
272 vs 315 ms at 128 rows, 546 vs 570 at 256) and block ahead only from 512 (869 vs
944 ms at 16k tokens, E 64); on the first machine (AMD EPYC) the two were within 3%
at 128 rows and block 6% ahead at 256, so 256 costs at most that there.
Every choice serves exactly the kept choices of the routing, so the drop decisions
do not depend on the pick; the numerics differ only in summation order.

Gin: `MoeConfig.dispatcher = @AutoDispatcher()` (the default);
`AutoDispatcher.einsum_max_elements = 0` never picks einsum.
"""
import dataclasses
from typing import Tuple

import gin
import jax

from openmoe_jax.kernels import target
from openmoe_jax.moe.dispatch.all_to_all import AllToAllDispatcher
from openmoe_jax.moe.dispatch.base import Dispatcher, ExpertWeights
from openmoe_jax.moe.dispatch.block import BlockDispatcher
from openmoe_jax.moe.dispatch.einsum import EinsumDispatcher
from openmoe_jax.moe.dispatch.primitives import expert_split_size
from openmoe_jax.moe.dispatch.ragged import RaggedDispatcher
from openmoe_jax.moe.dispatch.ragged_all_to_all import RaggedAllToAllDispatcher
from openmoe_jax.moe.dispatch.sort import SortDispatcher
from openmoe_jax.moe.routers import Routing

# device_kind prefixes of GPUs ("NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-16GB",
# "AMD Instinct MI300X"), for compile targets and faked backends in tests.
GPU_KIND_PREFIXES: Tuple[str, ...] = ("NVIDIA", "Tesla", "AMD")


def on_gpu() -> bool:
  """Returns whether dispatch is traced for a GPU: the compile target's (or device
  0's) device_kind names a GPU, or device 0 is a GPU and no TPU is targeted."""
  if target.target_kind().startswith(GPU_KIND_PREFIXES):
    return True
  return jax.devices()[0].platform == "gpu" and not target.on_tpu()


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AutoDispatcher:
  """Dispatches with the dispatcher `choose` returns for the platform and sizes."""

  einsum_max_experts: int = 16
  einsum_max_elements: int = 1 << 20  # s x E x C of the one-hot dispatch tensor
  ragged_buffer_ratio: float = 2.0  # E x C over s x k beyond which ragged serves
  block_min_rows: int = 256  # mean rows per expert from which block picks over sort

  def choose(self, tokens_per_group: int, num_experts: int, capacity: int,
             choices: int, num_groups: int = 1) -> Dispatcher:
    """Returns the dispatcher for `num_groups` groups of `tokens_per_group` tokens
    with `choices` options each (top-k; E for expert choice) and `capacity` slots
    per expert."""
    dropless = (num_experts * capacity
                > self.ragged_buffer_ratio * tokens_per_group * choices)
    experts_split = expert_split_size(jax.sharding.get_abstract_mesh()) > 1
    if target.on_tpu():
      if not experts_split:
        return RaggedDispatcher("pallas")
      if dropless and (target.tpu_generation() or 0) >= 4:
        return RaggedAllToAllDispatcher(backend="pallas")
      return AllToAllDispatcher(buffer_dispatcher=SortDispatcher())
    if on_gpu() and not experts_split:
      return RaggedDispatcher("ragged_dot") if dropless else SortDispatcher()
    if (num_experts <= self.einsum_max_experts
        and tokens_per_group * num_experts * capacity <= self.einsum_max_elements):
      return EinsumDispatcher()
    if not experts_split:
      rows_per_expert = num_groups * tokens_per_group * choices / num_experts
      if dropless or rows_per_expert >= self.block_min_rows:
        return BlockDispatcher()
      return SortDispatcher()
    if dropless:
      return RaggedDispatcher(backend="padded")
    return SortDispatcher()

  def __call__(self, x_gsd: jax.Array, routing: Routing,
               weights: ExpertWeights) -> jax.Array:
    dispatcher = self.choose(x_gsd.shape[1], weights.num_experts, routing.capacity,
                             routing.expert_index.shape[-1], x_gsd.shape[0])
    return dispatcher(x_gsd, routing, weights)
