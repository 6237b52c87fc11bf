"""Ahead-of-time TPU planner: compile the sharded train step for a TPU topology on
this machine (no TPU needed) and report per-chip memory, FLOPs and MFU. The
command line is cli/plan.py:

  openmoe-plan --gin_file=models/openmoe_8b_32e.gin --topology=v5p:4x4x4 \\
      --gin.BATCH_SIZE=1024 --gin.make_mesh.fsdp=-1 --gin.make_mesh.data=1 [--json]

Uses libtpu's description of the topology (`jax.experimental.topologies`), so
`pip install -e ".[tpu]"` (or the test extra) is needed; with no TPU attached the
CPU is picked by itself (cli/environment.py). Exit code 3: does not fit.
"""
import os
import re
import time
from typing import Any, Dict, Optional, Tuple

import gin
import jax
import jax.numpy as jnp

from openmoe_jax import flops, param_count, partitioning
from openmoe_jax.config import ModelConfig
from openmoe_jax.kernels import target
from openmoe_jax.layers.attention_impls import AutoAttention, attention_impl_of
from openmoe_jax.model import Decoder, layer_segments, scan_unit_length
from openmoe_jax.moe.layer import dispatcher_of
from openmoe_jax.objectives import CausalLm
from openmoe_jax.optim import adafactor_openmoe
from openmoe_jax.trainer import init_train_state, make_train_step

GIB = 1024 ** 3
# Per chip: HBM bytes and peak dense bf16 FLOP/s (public spec sheets).
CHIPS = {
    "TPU v3": (32 * GIB, 123e12),
    "TPU v4": (32 * GIB, 275e12),
    "TPU v5 lite": (16 * GIB, 197e12),
    "TPU v5": (95 * GIB, 459e12),
    "TPU v6 lite": (32 * GIB, 918e12),
}


# Per chip: HBM bandwidth in bytes/s (public spec sheets), for the roofline estimate.
HBM_BANDWIDTH = {
    "TPU v3": 900e9,
    "TPU v4": 1228e9,
    "TPU v5 lite": 819e9,
    "TPU v5": 2765e9,
    "TPU v6 lite": 1640e9,
}


TOPOLOGY_PATTERN = re.compile(r"^v\d+[a-z]*:\d+x\d+(x\d+)?$")
TOPOLOGY_EXAMPLES = "v5p:2x2x1, v5e:2x2, v4:2x2x2, v6e:4x4"


def topology_devices(topology: str):
  """Returns the TPU devices of `topology` (e.g. "v5p:2x2x1") from libtpu."""
  # Compiling needs no TPU, so several processes may load libtpu at once (tests,
  # a planner beside a training run) instead of failing on its lockfile.
  if not TOPOLOGY_PATTERN.match(topology):
    raise ValueError(f"--topology={topology!r} is not a TPU topology: write "
                     f"GENERATION:AxB[xC], e.g. {TOPOLOGY_EXAMPLES}")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
  except jax.errors.JaxRuntimeError as e:  # libtpu: unknown generation, bad shape
    reason = str(e).strip().splitlines()[0].replace("INVALID_ARGUMENT: ", "")
    raise ValueError(f"--topology={topology!r}: libtpu rejects it ({reason}); "
                     f"valid topologies look like {TOPOLOGY_EXAMPLES}") from e


COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-gather", "all-reduce",
               "reduce-scatter", "collective-permute")


def count_collectives(hlo_text: str) -> Dict[str, int]:
  """Returns how many instructions of each kind in COLLECTIVES the compiled HLO holds
  (async "-start" halves counted once; loop bodies once, like the FLOPs)."""
  counts = dict.fromkeys(COLLECTIVES, 0)
  for match in re.finditer(r" ([a-z-]+?)(?:-start)?\(", hlo_text):
    if match.group(1) in counts:
      counts[match.group(1)] += 1
  return counts


def analytic_train_flops(cfg: ModelConfig, batch_size: int, sequence_length: int) -> float:
  """Returns 6 x activated matmul params x tokens + attention (12 L T h d_h per token)."""
  counts = param_count.count_params(cfg)
  matmul_params = counts["activated"] - cfg.vocab_size * cfg.d_model  # lookup table
  tokens = batch_size * sequence_length
  attention = 12 * cfg.num_layers * sequence_length * cfg.num_heads * cfg.head_dim
  return float(tokens * (6 * matmul_params + attention))


def attention_name(cfg: ModelConfig, sequence_length: int) -> str:
  """Returns the name of the attention implementation the model runs at this
  length on the current target (`AutoAttention -> SplashAttention` for the default)."""
  impl = attention_impl_of(cfg.attention_impl)
  name = type(impl).__name__
  if isinstance(impl, AutoAttention):
    q = jax.ShapeDtypeStruct((1, sequence_length, cfg.num_heads, cfg.head_dim),
                             jnp.dtype(cfg.dtype))
    name += " -> " + type(impl.choose(q, q)).__name__
  return name


def _layer_flops(cfg: ModelConfig, sequence_length: int) -> Tuple[float, float]:
  """Returns the training FLOPs per token of one dense and of one MoE layer as
  compiled (capacity buffers counted: flops.model_flops_per_token's hardware
  count, spread evenly over the layers of each kind)."""
  counts = flops.model_flops_per_token(cfg, sequence_length)
  sparse = cfg.sparse_layers()
  num_moe = sum(sparse)
  attention = (counts["attention_projections"] + counts["attention_scores"]) / len(sparse)
  per_mlp = 6 * flops.mlp_matmul_params(cfg.mlp_kind, cfg.d_model, cfg.d_ff)
  dense = attention + per_mlp
  moe = attention + (per_mlp if cfg.moe.residual_mlp else 0.0)
  if num_moe:
    moe += (counts["experts_hardware"] + counts["router"]
            + counts["shared_experts"]) / num_moe
  return dense, moe


def loop_undercount(cfg: ModelConfig, sequence_length: int, microbatches: int) -> float:
  """Returns the factor by which XLA's cost analysis under-counts a train step.

  It counts a loop body once: each scanned segment of layers as one unit (not
  `repeats` of them), and the microbatch scan as one microbatch. The factor is
  (all layers + head) x microbatches / (each segment's unit once + head), with each
  layer weighed by its FLOPs (`_layer_flops`); the optimizer update, outside both
  loops, is neglected (it is elementwise)."""
  dense, moe = _layer_flops(cfg, sequence_length)
  cost = lambda layers: sum(moe if sparse else dense for sparse in layers)
  head = flops.model_flops_per_token(cfg, sequence_length)["head"]
  every_layer = cost(cfg.sparse_layers())
  if cfg.scan_layers:
    segments = layer_segments(cfg.sparse_layers(), scan_unit_length(cfg))
    seen = sum(cost(unit) for unit, _ in segments)
  else:
    seen = every_layer
  return microbatches * (every_layer + head) / (seen + head)


def roofline(flops_per_device: float, bytes_per_device: float, peak_flops: float,
             bandwidth: float) -> Dict[str, Any]:
  """Returns the roofline step-time estimate of one device: the larger of its
  compute time (FLOPs / peak) and its HBM time (bytes / bandwidth), and which one
  bounds it. An estimate: it ignores collectives, overlap and kernel efficiency.
  With scanned layers the byte count (XLA's, corrected by `loop_undercount`) is an
  upper bound: XLA counts whole stacked buffers in a loop body (6x the unrolled
  program's bytes on the tiny test model); the FLOPs agree to ~10%."""
  compute_s, memory_s = flops_per_device / peak_flops, bytes_per_device / bandwidth
  return {"step_s": max(compute_s, memory_s), "compute_s": compute_s,
          "memory_s": memory_s, "bound": "compute" if compute_s >= memory_s else "HBM"}


@gin.configurable
def plan(topology: str, batch_size: int, sequence_length: int = 2048,
         microbatches: int = 1, optimizer: Any = None,
         step_time_s: Optional[float] = None) -> Dict[str, Any]:
  """Compiles one train step of the gin-configured model for `topology`; returns
  the report dict (memory per chip from the compiled memory analysis, compiled vs
  analytic FLOPs, and the MFU at `step_time_s` when given, from the analytic count).

  XLA's cost analysis counts the body of a loop once, so `compiled_flops`
  under-counts scanned layers and microbatches by their trip counts; compile with
  `ModelConfig.scan_layers=False` and one microbatch to compare like with like.
  Nor does it see inside Pallas kernels (splash attention, the default on TPU; the
  grouped matmul).
  """
  for name, value in (("BATCH_SIZE", batch_size), ("SEQUENCE_LENGTH", sequence_length),
                      ("plan.microbatches", microbatches)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} must be an integer >= 1")
  if step_time_s is not None and not step_time_s > 0:
    raise ValueError(f"--step_time={step_time_s} must be > 0 seconds")
  devices = topology_devices(topology)
  kind = devices[0].device_kind
  if kind not in CHIPS:
    raise ValueError(f"unknown TPU kind {kind!r}; known: {sorted(CHIPS)}")
  hbm_per_chip, peak = CHIPS[kind]
  num_chips = len({tuple(d.coords) for d in devices})  # v3/v4: 2 cores per chip
  hbm_per_device = hbm_per_chip * num_chips // len(devices)
  cfg = ModelConfig()
  optimizer = optimizer or adafactor_openmoe(learning_rate=0.01, warmup_steps=10000)
  mesh = partitioning.make_mesh(devices=devices)
  shards = partitioning.batch_shards(mesh)
  if batch_size % (shards * microbatches):
    raise ValueError(f"BATCH_SIZE={batch_size} must be divisible by microbatches "
                     f"({microbatches}) x the {shards} batch shards of mesh "
                     f"{dict(mesh.shape)}: e.g. {shards * microbatches}")
  model = Decoder(cfg)
  start = time.perf_counter()
  key = jax.random.PRNGKey(0)  # made on the host CPU, outside the TPU mesh
  # compile_target: trace-time choices (AutoDispatcher, kernel dtypes) follow the
  # TPU being compiled for, not this CPU.
  with partitioning.activate(mesh), target.compile_target(devices[0]):
    attention = attention_name(cfg, sequence_length)
    _, abstract, state_sh = init_train_state(model, optimizer, mesh, key,
                                             sequence_length)
    batch_sh = partitioning.batch_sharding(mesh)
    struct = lambda dtype: jax.ShapeDtypeStruct((batch_size, sequence_length), dtype,
                                                sharding=batch_sh)
    batch = {k: struct(jnp.int32) for k in (
        "decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights",
        "decoder_segment_ids", "decoder_positions")}
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract, state_sh)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=partitioning.replicated(mesh))
    step = jax.jit(make_train_step(model, CausalLm(), optimizer, microbatches),
                   in_shardings=(state_sh, batch_sh, partitioning.replicated(mesh)),
                   out_shardings=(state_sh, partitioning.replicated(mesh)),
                   donate_argnums=(0,))
    lowered = step.lower(state, batch, rng)
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      # The TPU compiler refuses programs that cannot fit; that is the answer.
      return {"topology": topology, "device_kind": kind, "num_chips": num_chips,
              "num_devices": len(devices), "mesh": dict(mesh.shape),
              "attention": attention,
              "batch_size": batch_size, "sequence_length": sequence_length,
              "hbm_bytes_per_chip": hbm_per_chip, "hbm_bytes_per_device": hbm_per_device,
              "fits": False, "compiler_message": str(e).splitlines()[0][:500]}
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  analytic = analytic_train_flops(cfg, batch_size, sequence_length)
  peak_bytes = (memory.argument_size_in_bytes + memory.temp_size_in_bytes
                + memory.output_size_in_bytes - memory.alias_size_in_bytes)
  report = {
      "topology": topology, "device_kind": kind, "num_chips": num_chips,
      "num_devices": len(devices), "mesh": dict(mesh.shape),
      "dispatcher": type(dispatcher_of(cfg.moe)).__name__, "attention": attention,
      "batch_size": batch_size, "sequence_length": sequence_length,
      "hbm_bytes_per_chip": hbm_per_chip, "hbm_bytes_per_device": hbm_per_device,
      "argument_bytes": memory.argument_size_in_bytes,
      "temp_bytes": memory.temp_size_in_bytes,
      "output_bytes": memory.output_size_in_bytes,
      "alias_bytes": memory.alias_size_in_bytes,
      "peak_bytes_per_device": peak_bytes, "fits": peak_bytes <= hbm_per_device,
      "compiled_flops": float(cost.get("flops", 0.0)) * len(devices),
      "analytic_flops": analytic, "compile_seconds": time.perf_counter() - start,
      "collectives": count_collectives(compiled.as_text()),
  }
  correction = loop_undercount(cfg, sequence_length, microbatches)
  share = num_chips / len(devices)  # of a chip per device (v3: 2 cores per chip)
  estimate = roofline(float(cost.get("flops", 0.0)) * correction,
                      float(cost.get("bytes accessed", 0.0)) * correction,
                      peak * share, HBM_BANDWIDTH[kind] * share)
  report.update({
      "loop_correction": correction,
      "estimated_step_s": estimate["step_s"],
      "estimated_compute_s": estimate["compute_s"],
      "estimated_memory_s": estimate["memory_s"], "estimated_bound": estimate["bound"],
      "estimated_mfu": analytic / (estimate["step_s"] * num_chips * peak)})
  if step_time_s:
    report["mfu"] = analytic / (step_time_s * num_chips * peak)
  return report


def format_report(report: Dict[str, Any]) -> str:
  """Returns the report as readable lines."""
  gib = lambda b: f"{b / GIB:.2f} GiB"
  if "compiler_message" in report:
    return (f"{report['topology']}: mesh {report['mesh']}, attention "
            f"{report['attention']}, batch {report['batch_size']} "
            f"x {report['sequence_length']}: DOES NOT FIT ({report['compiler_message']})")
  lines = [
      f"{report['topology']} ({report['device_kind']}): {report['num_chips']} chips, "
      f"{report['num_devices']} devices, mesh {report['mesh']}, MoE dispatch "
      f"{report['dispatcher']}, attention {report['attention']}",
      f"batch {report['batch_size']} x {report['sequence_length']} tokens",
      f"per device: arguments {gib(report['argument_bytes'])}, temp "
      f"{gib(report['temp_bytes'])}, outputs {gib(report['output_bytes'])} (aliased "
      f"{gib(report['alias_bytes'])}) -> peak {gib(report['peak_bytes_per_device'])} "
      f"of {gib(report['hbm_bytes_per_device'])} HBM: "
      + ("fits" if report["fits"] else "DOES NOT FIT"),
      f"FLOPs per step: compiled {report['compiled_flops']:.3e} (XLA counts each loop "
      f"body once: scanned layers and microbatches), analytic "
      f"{report['analytic_flops']:.3e}",
      "collectives in the step: " + ", ".join(
          f"{name} {n}" for name, n in report["collectives"].items() if n),
  ]
  lines.append(
      f"roofline ESTIMATE (not a measurement; XLA's per-device FLOPs and bytes x "
      f"{report['loop_correction']:.2f} for the loops it counts once): step "
      f"{report['estimated_step_s'] * 1e3:.1f} ms (compute "
      f"{report['estimated_compute_s'] * 1e3:.1f} ms, HBM "
      f"{report['estimated_memory_s'] * 1e3:.1f} ms: {report['estimated_bound']}-bound)"
      f", implying MFU {100 * report['estimated_mfu']:.1f}%; collectives, overlap and "
      "Pallas kernels (invisible to the count) are not in it; with scanned layers the "
      "HBM term is an upper bound")
  if "mfu" in report:
    lines.append(f"MFU at the given step time: {100 * report['mfu']:.1f}%")
  return "\n".join(lines)
