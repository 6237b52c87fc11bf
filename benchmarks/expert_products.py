"""Per-expert products against one 2-D product of the same FLOPs, in pairs.

Usage: python benchmarks/expert_products.py [--json] [--rounds N] [--shapes r,d,f,E;...]

Why the MoE layer's floor (`benchmarks/moe_layer.py`'s `experts_floor` row) sits
above the dense MLP on a CPU, product by product. For E experts of r rows each and
a [d, f] weight per expert, each row times one of the three products a linear layer
runs in fwd+bwd, as the experts run them (one batched product: [E, r, .] x [E, ., .])
against the same FLOPs as one 2-D product of E x r rows and one [d, f] weight (what
the dense MLP runs):

- `forward`:       y[e] = x[e] @ w[e]                 vs  x @ w
- `input_grad`:    dx[e] = dy[e] @ w[e]^T              vs  dy @ w^T
- `weight_grad`:   dw[e] = x[e]^T @ dy[e] -> [E, d, f] vs  x^T @ dy -> [d, f]

The weight gradient also differs in what it writes: the experts' version writes E
[d, f] results (E times the bytes) from a contraction over r rows, the 2-D one a
single [d, f] from E x r rows (docs/performance.md has measured ratios of all
three). Method (benchmarks/timing.py): both programs
compiled first, then `--rounds` pairs (2-D, batched) after one untimed pair;
`ratio` is the median of the per-pair ratios batched / 2-D, `gflops` and
`gflops_2d` the achieved rates at the median times. float32 on the CPU; the
allocator setting of the library's CPU programs is applied first.
Default shapes: the experts of the layer benchmark's three configs at 4096 tokens
(r = 4096 x k / E rows per expert).
"""
import argparse
import json
import os
import statistics
import sys
from typing import Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import timing  # noqa: E402
from openmoe_jax.cli import environment, host_malloc  # noqa: E402

# (rows per expert, d, f, E): moe_layer.py's configs at 4096 tokens.
SHAPES = ((512, 768, 2048, 16), (128, 512, 512, 64), (128, 512, 256, 256))
KINDS = ("forward", "input_grad", "weight_grad")


def problem(kind: str, rows: int, d: int, f: int, experts: int
            ) -> Tuple[Callable, Tuple, Callable, Tuple]:
  """Returns (batched fn, its args, 2-D fn, its args) of product `kind`."""
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(keys[0], (experts, rows, d), jnp.float32)
  dy = jax.random.normal(keys[1], (experts, rows, f), jnp.float32)
  w = jax.random.normal(keys[2], (experts, d, f), jnp.float32)
  flat = lambda a: a.reshape(experts * rows, a.shape[-1])
  if kind == "forward":
    return (lambda x, w: jnp.einsum("erd,edf->erf", x, w), (x, w),
            lambda x, w: x @ w, (flat(x), w[0]))
  if kind == "input_grad":
    return (lambda dy, w: jnp.einsum("erf,edf->erd", dy, w), (dy, w),
            lambda dy, w: dy @ w.T, (flat(dy), w[0]))
  if kind == "weight_grad":
    return (lambda x, dy: jnp.einsum("erd,erf->edf", x, dy), (x, dy),
            lambda x, dy: x.T @ dy, (flat(x), flat(dy)))
  raise ValueError(f"unknown product {kind!r}; one of {KINDS}")


def time_shape(rows: int, d: int, f: int, experts: int, rounds: int,
               warmup: int = 1) -> List[Dict]:
  """Returns one row per product kind for E experts of `rows` rows, d -> f."""
  out = []
  flop = 2.0 * experts * rows * d * f
  for kind in KINDS:
    batched, args, dense, dense_args = problem(kind, rows, d, f, experts)
    run_b, *_ = timing.compile_fn(batched, *args)
    run_d, *_ = timing.compile_fn(dense, *dense_args)
    base, times = timing.paired_ms(lambda: run_d(*dense_args),
                                   {kind: lambda: run_b(*args)}, rounds, warmup)[kind]
    ms, ms_2d = statistics.median(times), statistics.median(base)
    out.append({"product": kind, "rows_per_expert": rows, "d": d, "f": f,
                "experts": experts, "rounds": rounds, "ms": round(ms, 3),
                "ms_2d": round(ms_2d, 3),
                **timing.spread(timing.per_round_ratios(times, base), "ratio"),
                "gflops": round(flop / ms / 1e6, 1),
                "gflops_2d": round(flop / ms_2d / 1e6, 1)})
  return out


def main(argv=None):
  if environment.runs_on_cpu():
    print(f"malloc: reuse freed memory {host_malloc.reuse_freed_memory()}",
          file=sys.stderr)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="one JSON object per row")
  parser.add_argument("--rounds", type=int, default=7, help="timed pairs per product")
  parser.add_argument("--shapes", default=SHAPES,
                      type=lambda text: timing.parse_shapes(text, ("rows", "d", "f", "E")),
                      help='"rows,d,f,E;..." (default: the layer benchmark\'s experts)')
  args = parser.parse_args(argv)
  load_start = timing.load_average()
  rows = []
  for shape in args.shapes:
    print(f"timing rows,d,f,E = {shape}", file=sys.stderr, flush=True)
    rows += time_shape(*shape, rounds=args.rounds)
  load = {"loadavg_start": load_start, "loadavg_end": timing.load_average()}
  if not args.json:
    print(f"load average {load['loadavg_start']} -> {load['loadavg_end']}; "
          "batched = E experts' products, 2-D = one product of the same FLOPs")
    print(f"{'product':12s} {'r,d,f,E':>18s} {'ms':>9s} {'ms 2-D':>9s} "
          f"{'ratio [min-max]':>20s} {'GFLOP/s':>8s} {'2-D':>7s}")
  for row in rows:
    if args.json:
      print(json.dumps({**row, **load}))
    else:
      shape = f"{row['rows_per_expert']},{row['d']},{row['f']},{row['experts']}"
      spread = f"{row['ratio']:.2f}x [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}]"
      print(f"{row['product']:12s} {shape:>18s} {row['ms']:9.2f} {row['ms_2d']:9.2f} "
            f"{spread:>20s} {row['gflops']:8.1f} {row['gflops_2d']:7.1f}")


if __name__ == "__main__":
  main()
