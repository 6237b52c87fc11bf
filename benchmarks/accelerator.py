"""One accelerator report: the MoE layer table and a ~1B-parameter MoE train step.

Usage: python benchmarks/accelerator.py --output=gpu.json [--tiny]

Runs on whatever device jax sees first (GPU, TPU or CPU) and writes ONE JSON file:

- `device`: device_kind, backend, device count, jax version;
- `moe_layer`: benchmarks/moe_layer.py's rows (its method: dense and every dispatcher
  timed in pairs with dense per path, median and spread, median per-pair ratio to dense,
  analytic useful FLOPs as a fraction of a bf16 matmul peak measured at the start
  and the end of the section, load average) for the issue's three configs in
  bfloat16, every dispatcher of `moe_layer.DISPATCHERS` ("auto" is the default
  dispatcher's pick for the platform: `SortDispatcher` on GPU for capacity routing),
  the experts-only floor and the router alone. Off the CPU each timed sample is
  back-to-back calls lasting at least `--min_sample_ms` (timing.paired_ms);
- `train_step`: tokens/s of the compiled train step (`trainer.Trainer`, causal LM,
  AdamW, bf16 activations, synthetic batches of 8 x 2048 tokens) of `MODEL_1B`
  (1.08B parameters, 0.34B matmul parameters activated per token: 16 layers of d
  1024, swiglu, every second one MoE with 16 experts of width 2048, top-2, OpenMoE's
  residual MLP of width 2816, the default dispatcher), median and spread of the
  timed steps, and MFU = tokens/s x `flops.model_flops_per_token` / (peak x
  devices) against the bf16 matmul peak measured here and, on a GPU in
  `GPU_PEAK_FLOPS` (H100/H200/A100 spec sheets, dense bf16), against the spec peak;
  if the default attention fails, the error and the step with `PlainAttention()`;
- `train_step_by_dispatcher`: the same step with each of `--train_dispatchers`.

Each section has a time budget (`--layer_budget_s`, `--train_budget_s`,
`--dispatcher_budget_s`; defaults keep the whole run under 8 minutes with compiles):
a section stops starting new configs or steps once its budget is spent, and lists
what it skipped; a config or dispatcher that fails is written into the JSON with its
error and the run goes on (one try on a lent GPU should not lose the rest).
`--tiny` shrinks every size so the script runs on a CPU in well under a minute (the
tests). Run on one NVIDIA H200 on 2026-12-04: README, docs/benchmarks/.
"""
import argparse
import dataclasses
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
from openmoe_jax.layers.attention_impls import PlainAttention  # noqa: E402
from openmoe_jax.model import Decoder  # noqa: E402
from openmoe_jax.moe.dispatch import AutoDispatcher, BlockDispatcher  # noqa: E402
from openmoe_jax.moe.dispatch import EinsumDispatcher, RaggedDispatcher  # noqa: E402
from openmoe_jax.moe.dispatch import SortDispatcher  # noqa: E402
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


def error_text(error: Exception) -> str:
  """Returns `error`'s type and the first 2000 characters of its message."""
  return f"{type(error).__name__}: {str(error)[:2000]}"


def layer_section(shapes, dispatchers, rounds: int, budget_s: float,
                  min_sample_ms: float) -> Dict[str, Any]:
  """Returns {"rows", "skipped", "failed", run info}: moe_layer's paired rows in
  bf16 for each shape started within `budget_s` seconds, each timed sample at least
  `min_sample_ms` long (timing.paired_ms). A shape whose paths fail to compile or
  run is listed under "failed" with the error, and the next shape goes on."""
  dtype = jnp.bfloat16
  start, skipped, failed, rows = time.perf_counter(), [], {}, []
  load_start, peak_start = timing.load_average(), timing.matmul_peak(dtype)
  for config, shape in shapes.items():
    if time.perf_counter() - start > budget_s:
      skipped.append(config)
      continue
    print(f"moe_layer {config} {shape}", file=sys.stderr, flush=True)
    try:
      rows += moe_layer.time_shape(config, shape, dispatchers, rounds, 1, dtype,
                                   min_sample_ms)
    except Exception as error:  # pylint: disable=broad-except
      failed[config] = error_text(error)
      print(f"moe_layer {config} failed: {failed[config][:300]}", file=sys.stderr)
  peak_end, load_end = timing.matmul_peak(dtype), timing.load_average()
  moe_layer.finish_rows(rows, peak_start, peak_end, load_start, load_end)
  return {"rows": rows, "skipped_configs": skipped, "failed_configs": failed,
          "dtype": "bfloat16", "rounds": rounds, "min_sample_ms": min_sample_ms,
          "peak_flops_start": peak_start, "peak_flops_end": peak_end,
          "loadavg_start": load_start, "loadavg_end": load_end,
          "seconds": round(time.perf_counter() - start, 1)}


def dispatcher_label(cfg: ModelConfig, batch_tokens: int) -> str:
  """Returns the repr of `cfg`'s MoE dispatcher, or where it is AutoDispatcher (None
  is) "AutoDispatcher -> " and the one it picks on this platform and the current
  mesh, in training."""
  moe = cfg.moe
  if moe.dispatcher is not None and not isinstance(moe.dispatcher, AutoDispatcher):
    return repr(moe.dispatcher)
  group = min(moe.group_size, batch_tokens)
  capacity = router_of(moe).capacity(
      group, num_experts=moe.num_experts, top_k=moe.top_k,
      capacity_factor=moe.capacity_factor(True), min_capacity=moe.min_capacity)
  picked = AutoDispatcher().choose(group, moe.num_experts, capacity, moe.top_k)
  return f"AutoDispatcher -> {picked!r}"


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
    dispatcher = dispatcher_label(cfg, batch_size * length)
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
      "dispatcher": dispatcher, "dtype": cfg.dtype,
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


def train_with_fallback(cfg: ModelConfig, batch_size: int, length: int,
                        max_steps: int, budget_s: float) -> Dict[str, Any]:
  """Returns `train_section` of `cfg` with its default attention; if that fails
  (a cuDNN attention this jax or GPU refuses, say), the error under
  "default_attention_error" and the section again with `PlainAttention()`."""
  try:
    return {"attention": "default (AutoAttention)",
            **train_section(cfg, batch_size, length, max_steps, budget_s)}
  except Exception as error:  # pylint: disable=broad-except
    message = error_text(error)
    print(f"train step failed with the default attention: {message[:300]}",
          file=sys.stderr)
  plain = dataclasses.replace(cfg, attention_impl=PlainAttention())
  return {"attention": "PlainAttention (fallback)",
          "default_attention_error": message,
          **train_section(plain, batch_size, length, max_steps, budget_s)}


# Dispatchers the train step is also timed with (`--train_dispatchers`), each in
# place of the default one for every MoE layer of the model.
TRAIN_DISPATCHERS = {"einsum": EinsumDispatcher(), "sort": SortDispatcher(),
                     "block": BlockDispatcher(),
                     "ragged_dot": RaggedDispatcher("ragged_dot")}


def train_by_dispatcher(cfg: ModelConfig, names, batch_size: int, length: int,
                        max_steps: int, budget_s: float) -> Dict[str, Any]:
  """Returns {name: train_section's tokens/s, step times and MFU} of `cfg` with
  each named dispatcher of `TRAIN_DISPATCHERS` (a failure: {"error": ...})."""
  keep = ("dispatcher", "step_ms", "step_ms_min", "step_ms_max", "steps_timed",
          "tokens_per_s", "mfu_measured_peak", "mfu_spec_peak",
          "compile_and_warmup_s")
  results = {}
  for name in names:
    print(f"train step with {name}", file=sys.stderr, flush=True)
    moe = dataclasses.replace(cfg.moe, dispatcher=TRAIN_DISPATCHERS[name])
    try:
      section = train_section(dataclasses.replace(cfg, moe=moe), batch_size, length,
                              max_steps, budget_s)
      results[name] = {k: section[k] for k in keep}
    except Exception as error:  # pylint: disable=broad-except
      results[name] = {"error": error_text(error)}
  return results


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
  parser.add_argument("--train_dispatchers", default="einsum,sort,block,ragged_dot",
                      help="comma-separated TRAIN_DISPATCHERS the train step is "
                           "also timed with ('' for none)")
  parser.add_argument("--dispatcher_budget_s", type=float, default=30.0,
                      help="timing budget of each --train_dispatchers entry")
  parser.add_argument("--min_sample_ms", type=float, default=20.0,
                      help="off CPU: each layer-table sample is back-to-back calls "
                           "lasting at least this long (timing.paired_ms)")
  args = parser.parse_args(argv)
  names = [n for n in args.train_dispatchers.split(",") if n]
  unknown = sorted(set(names) - set(TRAIN_DISPATCHERS))
  if unknown:
    parser.error(f"--train_dispatchers: unknown {unknown}; "
                 f"known: {sorted(TRAIN_DISPATCHERS)}")
  start = time.perf_counter()
  if args.tiny:
    shapes, dispatchers = LAYER_TINY, TINY_DISPATCHERS
    cfg, train = MODEL_TINY, TRAIN_TINY
  else:
    shapes = moe_layer.CONFIGS
    dispatchers = tuple(moe_layer.DISPATCHERS) + (moe_layer.FLOOR, moe_layer.ROUTER)
    cfg, train = MODEL_1B, TRAIN_1B
  rounds = args.rounds or (2 if args.tiny else 5)
  steps = args.train_steps or (3 if args.tiny else 20)
  report = {"device": device_info(), "tiny": args.tiny,
            "loadavg_start": timing.load_average()}
  on_cpu = jax.devices()[0].platform == "cpu"
  report["moe_layer"] = layer_section(shapes, dispatchers, rounds, args.layer_budget_s,
                                      0.0 if on_cpu else args.min_sample_ms)
  report["train_step"] = train_with_fallback(cfg, train["batch_size"],
                                             train["sequence_length"], steps,
                                             args.train_budget_s)
  report["train_step_by_dispatcher"] = train_by_dispatcher(
      cfg, names, train["batch_size"], train["sequence_length"],
      min(steps, 10), args.dispatcher_budget_s)
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
