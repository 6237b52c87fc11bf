"""MoE layer forward+backward per dispatcher vs the dense gated MLP of equal active FLOPs.

Usage: python benchmarks/moe_layer.py [--quick] [--json] [--runs N] [--dispatchers a,b]
       python benchmarks/moe_layer.py --sweep [--json]   (scaling in tokens and in E)

Each row times `jax.jit(value_and_grad)` of the MoE layer (router + dispatch +
experts + combine; swiglu experts) on one batch: median of `--runs` runs after
warm-up, next to a dense swiglu MLP of hidden width top_k x expert d_ff on all tokens,
timed in the same process. Peak bytes: temp + argument bytes of the compiled
program (`memory_analysis()`). `capacity_factor` counts per routed choice (MaxText's
convention: buffers hold cf x tokens x top_k / E rows per expert; the library's
`MoeConfig.capacity_factor_train` is per token, so it gets cf x top_k); dropless rows
have capacity_factor None and no padding beyond the grouped matmul's tile.

`--sweep` times the scaling instead: tokens 1k -> 16k at (d 512, f 512, E 64, k 2),
then E 16 -> 256 at 4096 tokens (d 512, f 512, k 2); rows are named "tokens_sweep"
/ "experts_sweep". Einsum rows whose one-hot dispatch tensor would exceed
`--max_einsum_elements` are skipped (a note goes to stderr).
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from openmoe_jax.config import MoeConfig  # noqa: E402
from openmoe_jax.layers.mlp import Mlp  # noqa: E402
from openmoe_jax.moe.dispatch import (AutoDispatcher, EinsumDispatcher,  # noqa: E402
                                      RaggedDispatcher, SortDispatcher)
from openmoe_jax.moe.layer import MoeLayer  # noqa: E402
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter  # noqa: E402

CONFIGS = {  # name: (d_model, expert d_ff, experts, top_k, tokens)
    "d768_f2048_e16_k2": (768, 2048, 16, 2, 4096),
    "d512_f512_e64_k2": (512, 512, 64, 2, 4096),
    "d512_f256_e256_k8": (512, 256, 256, 8, 4096),
}
QUICK_TOKENS = 1024
CAPACITY_FACTOR = 1.25
DISPATCHERS = {  # name: (dispatcher, dropless)
    "einsum": (EinsumDispatcher(), False),
    "sort": (SortDispatcher(), False),
    "ragged_padded_cf": (RaggedDispatcher("padded"), False),
    "ragged_padded_dropless": (RaggedDispatcher("padded"), True),
    "ragged_dot_dropless": (RaggedDispatcher("ragged_dot"), True),
    "auto": (AutoDispatcher(), False),
}
DEFAULT_DISPATCHERS = ("einsum", "sort", "ragged_padded_cf", "ragged_padded_dropless")
SWEEP_DISPATCHERS = ("einsum", "sort", "ragged_padded_dropless")
SWEEP_BASE = (512, 512, 64, 2, 4096)  # (d_model, d_ff, experts, top_k, tokens)
SWEEP_TOKENS = (1024, 2048, 4096, 8192, 16384)  # at the base's E
SWEEP_EXPERTS = (16, 32, 64, 128, 256)  # at the base's tokens


def sweep_shapes():
  """Returns [(config name, shape)] of the scaling sweep."""
  d, f, experts, k, tokens = SWEEP_BASE
  rows = [("tokens_sweep", (d, f, experts, k, t)) for t in SWEEP_TOKENS]
  return rows + [("experts_sweep", (d, f, e, k, tokens)) for e in SWEEP_EXPERTS]


def einsum_elements(shape) -> int:
  """Returns s x E x C of the einsum path's one-hot dispatch tensor (one group)."""
  _, _, experts, top_k, tokens = shape
  capacity = max(int(round(CAPACITY_FACTOR * top_k * tokens / experts)), 1)
  return tokens * experts * capacity


def _time_and_memory(fn, *args, runs: int, warmup: int):
  """Returns (median ms of jitted fn(*args), temp + argument bytes when compiled)."""
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  peak = None if mem is None else int(mem.temp_size_in_bytes
                                      + mem.argument_size_in_bytes)
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times), peak


def _inputs(d_model: int, tokens: int):
  """Returns (x [1, tokens, d], cotangent of the same shape)."""
  x_btd = jax.random.normal(jax.random.PRNGKey(0), (1, tokens, d_model))
  ct_btd = jax.random.normal(jax.random.PRNGKey(1), (1, tokens, d_model))
  return x_btd, ct_btd


def _fwd_bwd(module, **kwargs):
  """Returns loss_and_grads(params, x, ct) of sum(module(x) * ct)."""
  def loss(params, x_btd, ct_btd):
    y = module.apply(params, x_btd, **kwargs)
    y_btd = y[0] if isinstance(y, tuple) else y
    return jnp.sum(y_btd.astype(jnp.float32) * ct_btd)
  return jax.value_and_grad(loss, argnums=(0, 1))


def dense_problem(shape):
  """Returns (loss_and_grads, params, x, ct) of the dense swiglu MLP of width
  top_k x d_ff that `dense_ms` times."""
  d_model, d_ff, _, top_k, tokens = shape
  x_btd, ct_btd = _inputs(d_model, tokens)
  mlp = Mlp("swiglu", top_k * d_ff)
  params = nn.unbox(mlp.init(jax.random.PRNGKey(2), x_btd))
  return _fwd_bwd(mlp), params, x_btd, ct_btd


def dense_ms(shape, runs: int = 5, warmup: int = 2):
  """Returns (ms, peak bytes) of the dense swiglu MLP of width top_k x d_ff."""
  fn, params, x_btd, ct_btd = dense_problem(shape)
  return _time_and_memory(fn, params, x_btd, ct_btd, runs=runs, warmup=warmup)


def moe_problem(shape, dispatcher: str):
  """Returns (loss_and_grads, params, x, ct) of the MoE layer of `shape` with
  `dispatcher` that `bench_row` times: one group of all tokens, train mode."""
  d_model, d_ff, experts, top_k, tokens = shape
  engine, dropless = DISPATCHERS[dispatcher]
  cf = None if dropless else CAPACITY_FACTOR
  router = TokenChoiceRouter(dropless=dropless)
  cfg = MoeConfig(num_experts=experts, top_k=top_k, group_size=tokens,
                  capacity_factor_train=(cf or 1.0) * top_k, min_capacity=1,
                  router=router, dispatcher=engine)
  x_btd, ct_btd = _inputs(d_model, tokens)
  layer = MoeLayer(cfg, "swiglu", d_ff)
  params = nn.unbox(layer.init(jax.random.PRNGKey(2), x_btd, train=True))
  return _fwd_bwd(layer, train=True), params, x_btd, ct_btd


def bench_row(config: str, shape, dispatcher: str, dense: float, runs: int = 5,
              warmup: int = 2):
  """Returns one result row (dict) for the MoE layer of `shape` with `dispatcher`."""
  d_model, d_ff, experts, top_k, tokens = shape
  cf = None if DISPATCHERS[dispatcher][1] else CAPACITY_FACTOR
  fn, params, x_btd, ct_btd = moe_problem(shape, dispatcher)
  ms, peak = _time_and_memory(fn, params, x_btd, ct_btd, runs=runs, warmup=warmup)
  return {"config": config, "dispatcher": dispatcher, "tokens": tokens,
          "experts": experts, "top_k": top_k, "d_model": d_model, "d_ff": d_ff,
          "capacity_factor": cf, "ms": round(ms, 3), "dense_ms": round(dense, 3),
          "ratio_to_dense": round(ms / dense, 3), "peak_bytes": peak}


def _print_row(row, as_json: bool):
  """Prints one result row as JSON or as a table line."""
  if as_json:
    print(json.dumps(row), flush=True)
    return
  peak = row["peak_bytes"] / 2**20 if row["peak_bytes"] else float("nan")
  print(f"{row['config']:20} {row['dispatcher']:24} {row['tokens']:6d} "
        f"{row['experts']:4d} {str(row['capacity_factor']):>5} {row['ms']:9.2f} "
        f"{row['dense_ms']:9.2f} {row['ratio_to_dense']:6.2f} {peak:9.1f}", flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help=f"{QUICK_TOKENS} tokens")
  parser.add_argument("--sweep", action="store_true",
                      help="scaling sweep: tokens 1k-16k, then E 16-256")
  parser.add_argument("--json", action="store_true", help="one JSON object per row")
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--configs", default=",".join(CONFIGS))
  parser.add_argument("--dispatchers", default=None,
                      help=f"from {sorted(DISPATCHERS)}")
  parser.add_argument("--max_einsum_elements", type=int, default=1 << 28)
  args = parser.parse_args(argv)
  if args.sweep:
    shapes = sweep_shapes()
    dispatchers = args.dispatchers or ",".join(SWEEP_DISPATCHERS)
  else:
    shapes = [(c, CONFIGS[c][:4] + (QUICK_TOKENS,) if args.quick else CONFIGS[c])
              for c in args.configs.split(",")]
    dispatchers = args.dispatchers or ",".join(DEFAULT_DISPATCHERS)
  if not args.json:
    print(f"{'config':20} {'dispatcher':24} {'tokens':>6} {'E':>4} {'cf':>5} "
          f"{'ms':>9} {'dense_ms':>9} {'ratio':>6} {'peak_MiB':>9}")
  for config, shape in shapes:
    dense, _ = dense_ms(shape, args.runs, args.warmup)
    for dispatcher in dispatchers.split(","):
      if dispatcher == "einsum" and einsum_elements(shape) > args.max_einsum_elements:
        print(f"skip einsum at {config} {shape}: dispatch tensor of "
              f"{einsum_elements(shape)} elements", file=sys.stderr)
        continue
      _print_row(bench_row(config, shape, dispatcher, dense, args.runs, args.warmup),
                 args.json)


if __name__ == "__main__":
  main()
