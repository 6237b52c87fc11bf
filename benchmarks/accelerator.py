"""One accelerator report: the MoE layer table and a ~1B-parameter MoE train step.

Usage: python benchmarks/accelerator.py --output=gpu.json [--tiny]

Runs on whatever device jax sees first (GPU, TPU or CPU) and writes ONE JSON file:

- `device`: device_kind, backend, device count, jax version;
- `moe_layer`: benchmarks/moe_layer.py's rows (its method: dense and every dispatcher
  timed in pairs with dense per path, median and spread, median per-pair ratio to dense,
  analytic useful FLOPs as a fraction of a bf16 matmul peak measured at the start
  and the end of the section, load average) for the issue's three configs in
  bfloat16, every dispatcher of `moe_layer.DISPATCHERS` ("auto" is the default
  dispatcher's pick for the platform: `RaggedDispatcher("ragged_dot")` on GPU);
- `train_step`: tokens/s of the compiled train step (`trainer.Trainer`, causal LM,
  AdamW, bf16 activations, synthetic batches of 8 x 2048 tokens) of `MODEL_1B`
  (1.08B parameters, 0.34B matmul parameters activated per token: 16 layers of d
  1024, swiglu, every second one MoE with 16 experts of width 2048, top-2, OpenMoE's
  residual MLP of width 2816, the default dispatcher), median and spread of the
  timed steps, and MFU = tokens/s x `flops.model_flops_per_token` / (peak x
  devices) against the bf16 matmul peak measured here and, on a GPU in
  `GPU_PEAK_FLOPS` (H100/H200/A100 spec sheets, dense bf16), against the spec peak.

Each section has a time budget (`--layer_budget_s`, `--train_budget_s`; defaults
keep the whole run under 8 minutes with compiles): a section stops starting new
configs or steps once its budget is spent, and lists what it skipped. `--tiny`
shrinks every size so the script runs on a CPU in well under a minute (the tests).
Not run on a GPU yet.
"""
import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from benchmarks import moe_layer, timing  # noqa: E402
from openmoe_jax import flops, partitioning  # noqa: E402
from openmoe_jax.config import ModelConfig, MoeConfig  # noqa: E402
from openmoe_jax.model import Decoder  # noqa: E402
from openmoe_jax.moe.dispatch import AutoDispatcher  # noqa: E402
from openmoe_jax.moe.layer import router_of  # noqa: E402
from openmoe_jax.objectives import CausalLm  # noqa: E402
from openmoe_jax.trainer import Trainer  # noqa: E402

# Dense bf16 peak FLOP/s per GPU (spec sheets, no sparsity), by a device_kind
# substring; the first match wins (PCIe before the SXM default).
GPU_PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12),
                  ("H800", 989e12), ("A100", 312e12))

MODEL_1B = ModelConfig(
    vocab_size=32000, d_model=1024, num_heads=16, head_dim=64, d_ff=2816,
    num_layers=16, sparse_interval=2, mlp_kind="swiglu", dtype="bfloat16",
    moe=MoeConfig(num_experts=16, top_k=2, expert_d_ff=2048, group_size=4096))
TRAIN_1B = {"batch_size": 8, "sequence_length": 2048}

MODEL_TINY = ModelConfig(
    vocab_size=128, d_model=32, num_heads=2, head_dim=16, d_ff=64, num_layers=2,
    sparse_interval=2, mlp_kind="swiglu", dtype="bfloat16",
    moe=MoeConfig(num_experts=4, top_k=2, expert_d_ff=32, group_size=64))
TRAIN_TINY = {"batch_size": 2, "sequence_length": 32}
LAYER_TINY = {"tiny_e8_k2": (32, 32, 8, 2, 128)}
TINY_DISPATCHERS = ("einsum", "sort", "ragged_dot_dropless", "auto")


def device_info() -> Dict[str, Any]:
  """Returns device 0's kind, the backend, the device count and the jax version."""
  return {"device_kind": jax.devices()[0].device_kind,
          "backend": jax.default_backend(), "device_count": jax.device_count(),
          "jax_version": jax.__version__}


def spec_peak_flops(device_kind: str):
  """Returns the dense bf16 spec-sheet peak of a known GPU kind, else None."""
  for name, peak in GPU_PEAK_FLOPS:
    if name in device_kind:
      return peak
  return None


def layer_section(shapes, dispatchers, rounds: int, budget_s: float) -> Dict[str, Any]:
  """Returns {"rows", "skipped", run info}: moe_layer's paired rows in bf16 for
  each shape started within `budget_s` seconds."""
  dtype = jnp.bfloat16
  start, skipped, rows = time.perf_counter(), [], []
  load_start, peak_start = timing.load_average(), timing.matmul_peak(dtype)
  for config, shape in shapes.items():
    if time.perf_counter() - start > budget_s:
      skipped.append(config)
      continue
    print(f"moe_layer {config} {shape}", file=sys.stderr, flush=True)
    rows += moe_layer.time_shape(config, shape, dispatchers, rounds, 1, dtype)
  peak_end, load_end = timing.matmul_peak(dtype), timing.load_average()
  moe_layer.finish_rows(rows, peak_start, peak_end, load_start, load_end)
  return {"rows": rows, "skipped_configs": skipped, "dtype": "bfloat16",
          "rounds": rounds, "peak_flops_start": peak_start, "peak_flops_end": peak_end,
          "loadavg_start": load_start, "loadavg_end": load_end,
          "seconds": round(time.perf_counter() - start, 1)}


def default_dispatcher(cfg: ModelConfig, batch_tokens: int) -> str:
  """Returns the repr of the dispatcher AutoDispatcher picks for `cfg`'s MoE layers
  on this platform and the current mesh, in training."""
  moe = cfg.moe
  group = min(moe.group_size, batch_tokens)
  capacity = router_of(moe).capacity(
      group, num_experts=moe.num_experts, top_k=moe.top_k,
      capacity_factor=moe.capacity_factor(True), min_capacity=moe.min_capacity)
  return repr(AutoDispatcher().choose(group, moe.num_experts, capacity, moe.top_k))


def train_section(cfg: ModelConfig, batch_size: int, length: int, max_steps: int,
                  budget_s: float) -> Dict[str, Any]:
  """Returns the train step's tokens/s (median over timed steps after one compile
  step and one warm-up step), its spread, the FLOPs per token and the MFU."""
  start = time.perf_counter()
  peak_measured = timing.matmul_peak(jnp.bfloat16)  # outside the mesh (flops.py)
  on_cpu = jax.devices()[0].platform == "cpu"
  mesh = partitioning.make_mesh(1 if on_cpu else None)
  devices = flops.peak_devices(mesh)
  counts = flops.model_flops_per_token(cfg, length, batch_tokens=batch_size * length)
  batch = timing.synthetic_batch(cfg.vocab_size, batch_size, length)
  with partitioning.activate(mesh):
    trainer = Trainer(Decoder(cfg), CausalLm(),
                      optax.inject_hyperparams(optax.adamw)(learning_rate=1e-4),
                      mesh, length)
    dispatcher = default_dispatcher(cfg, batch_size * length)
    state = trainer.init_state(jax.random.PRNGKey(0))
    params = sum(x.size for x in jax.tree.leaves(state.params))
    rng = jax.random.PRNGKey(1)
    t0 = time.perf_counter()
    for _ in range(2):  # compile, then one warm-up step
      state, metrics = trainer.train_step(state, batch, rng)
      jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    step_ms = []
    while len(step_ms) < max_steps and (
        len(step_ms) < 2 or time.perf_counter() - start < budget_s):
      t0 = time.perf_counter()
      state, metrics = trainer.train_step(state, batch, rng)
      jax.block_until_ready(metrics)
      step_ms.append((time.perf_counter() - t0) * 1e3)
  tokens_per_s = batch_size * length / (statistics.median(step_ms) * 1e-3)
  spec = spec_peak_flops(jax.devices()[0].device_kind)
  return {
      "parameters": int(params),
      "model_flops_per_token": counts["total"],
      "hardware_flops_per_token": counts["hardware_total"],
      "batch_size": batch_size, "sequence_length": length, "devices": devices,
      "dispatcher": f"AutoDispatcher -> {dispatcher}", "dtype": cfg.dtype,
      "steps_timed": len(step_ms), **timing.spread(step_ms, "step_ms"),
      "compile_and_warmup_s": round(compile_s, 1),
      "tokens_per_s": round(tokens_per_s, 1),
      "loss": float(metrics["loss"]),
      "peak_flops_measured": peak_measured,
      "mfu_measured_peak": round(flops.mfu(tokens_per_s, counts["total"],
                                           peak_measured, devices), 4),
      "peak_flops_spec": spec,
      "mfu_spec_peak": None if spec is None else round(
          flops.mfu(tokens_per_s, counts["total"], spec, devices), 4),
      "seconds": round(time.perf_counter() - start, 1)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output", required=True, help="path of the JSON written")
  parser.add_argument("--tiny", action="store_true", help="CPU-sized, < 60 s")
  parser.add_argument("--rounds", type=int, default=None,
                      help="timed pairs per path of the layer table (5; tiny 2)")
  parser.add_argument("--layer_budget_s", type=float, default=240.0)
  parser.add_argument("--train_budget_s", type=float, default=150.0)
  parser.add_argument("--train_steps", type=int, default=None,
                      help="most timed train steps (20; tiny 3)")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  if args.tiny:
    shapes, dispatchers = LAYER_TINY, TINY_DISPATCHERS
    cfg, train = MODEL_TINY, TRAIN_TINY
  else:
    shapes, dispatchers = moe_layer.CONFIGS, tuple(moe_layer.DISPATCHERS)
    cfg, train = MODEL_1B, TRAIN_1B
  rounds = args.rounds or (2 if args.tiny else 5)
  steps = args.train_steps or (3 if args.tiny else 20)
  report = {"device": device_info(), "tiny": args.tiny,
            "loadavg_start": timing.load_average()}
  report["moe_layer"] = layer_section(shapes, dispatchers, rounds, args.layer_budget_s)
  report["train_step"] = train_section(cfg, train["batch_size"],
                                       train["sequence_length"], steps,
                                       args.train_budget_s)
  report["loadavg_end"] = timing.load_average()
  report["seconds"] = round(time.perf_counter() - start, 1)
  with open(args.output, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {args.output} ({report['seconds']} s): train step "
        f"{report['train_step']['tokens_per_s']} tokens/s, MFU "
        f"{report['train_step']['mfu_measured_peak']} of the measured peak",
        file=sys.stderr)


if __name__ == "__main__":
  main()
