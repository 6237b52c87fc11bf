"""Per-expert products against one 2-D product of the same FLOPs, in pairs.

Usage: python benchmarks/expert_products.py [--json] [--rounds N] [--shapes r,d,f,E;...]
                                            [--libraries xla,numpy]

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

`--libraries` (default both) also runs the same pairs through NumPy's `matmul`, i.e.
the BLAS NumPy was built with (OpenBLAS in NumPy's wheels; named in the header and
in each JSON row), with the same method: whether products of few rows lose against
one 2-D product in XLA:CPU's kernels only, or in the CPU's BLAS as well.
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
import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402
from openmoe_jax.cli import environment, host_malloc  # noqa: E402

# (rows per expert, d, f, E): moe_layer.py's configs at 4096 tokens.
SHAPES = ((512, 768, 2048, 16), (128, 512, 512, 64), (128, 512, 256, 256))
KINDS = ("forward", "input_grad", "weight_grad")
LIBRARIES = ("xla", "numpy")


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


def numpy_problem(kind: str, rows: int, d: int, f: int, experts: int
                  ) -> Tuple[Callable, Tuple, Callable, Tuple]:
  """`problem`'s products and operands as NumPy matmuls (NumPy's BLAS), the
  operands laid out as `problem` lays them (transposes are views, as BLAS takes
  them)."""
  _, args, _, dense_args = problem(kind, rows, d, f, experts)
  args, dense_args = (tuple(np.asarray(a) for a in group) for group in (args, dense_args))
  if kind == "forward":
    return np.matmul, args, np.matmul, dense_args
  if kind == "input_grad":
    return (lambda dy, w: np.matmul(dy, w.transpose(0, 2, 1)), args,
            lambda dy, w: dy @ w.T, dense_args)
  return (lambda x, dy: np.matmul(x.transpose(0, 2, 1), dy), args,
          lambda x, dy: x.T @ dy, dense_args)


def blas_name() -> str:
  """Returns the BLAS NumPy was built with, e.g. "scipy-openblas 0.3.31"."""
  try:
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
  except Exception:  # noqa: BLE001  (older NumPy: no dict form)
    return "unknown"


def time_shape(rows: int, d: int, f: int, experts: int, rounds: int,
               warmup: int = 1, library: str = "xla") -> List[Dict]:
  """Returns one row per product kind for E experts of `rows` rows, d -> f, run by
  `library` ("xla": jit-compiled; "numpy": NumPy's BLAS)."""
  if library not in LIBRARIES:
    raise ValueError(f"unknown library {library!r}; one of {LIBRARIES}")
  out = []
  flop = 2.0 * experts * rows * d * f
  for kind in KINDS:
    if library == "xla":
      batched, args, dense, dense_args = problem(kind, rows, d, f, experts)
      run_b, *_ = timing.compile_fn(batched, *args)
      run_d, *_ = timing.compile_fn(dense, *dense_args)
    else:
      run_b, args, run_d, dense_args = numpy_problem(kind, rows, d, f, experts)
    base, times = timing.paired_ms(lambda: run_d(*dense_args),
                                   {kind: lambda: run_b(*args)}, rounds, warmup)[kind]
    ms, ms_2d = statistics.median(times), statistics.median(base)
    out.append({"product": kind, "library": library if library == "xla" else
                f"numpy ({blas_name()})", "rows_per_expert": rows, "d": d, "f": f,
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
  parser.add_argument("--libraries", default=",".join(LIBRARIES), type=_libraries,
                      help="who runs the products, comma-separated: xla (jit) and/or "
                           f"numpy (NumPy's BLAS: {blas_name()}); default both")
  args = parser.parse_args(argv)
  load_start = timing.load_average()
  rows = []
  for library in args.libraries:
    for shape in args.shapes:
      print(f"timing {library}: rows,d,f,E = {shape}", file=sys.stderr, flush=True)
      rows += time_shape(*shape, rounds=args.rounds, library=library)
  load = {"loadavg_start": load_start, "loadavg_end": timing.load_average()}
  if not args.json:
    print(f"load average {load['loadavg_start']} -> {load['loadavg_end']}; "
          "batched = E experts' products, 2-D = one product of the same FLOPs; "
          f"numpy = NumPy's BLAS ({blas_name()})")
    print(f"{'product':12s} {'library':8s} {'r,d,f,E':>18s} {'ms':>9s} {'ms 2-D':>9s} "
          f"{'ratio [min-max]':>20s} {'GFLOP/s':>8s} {'2-D':>7s}")
  for row in rows:
    if args.json:
      print(json.dumps({**row, **load}))
    else:
      shape = f"{row['rows_per_expert']},{row['d']},{row['f']},{row['experts']}"
      spread = f"{row['ratio']:.2f}x [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}]"
      library = row["library"].split(" ")[0]
      print(f"{row['product']:12s} {library:8s} {shape:>18s} {row['ms']:9.2f} "
            f"{row['ms_2d']:9.2f} {spread:>20s} {row['gflops']:8.1f} {row['gflops_2d']:7.1f}")


def _libraries(text: str) -> Tuple[str, ...]:
  """argparse type of --libraries: names from LIBRARIES, comma-separated."""
  names = tuple(name.strip() for name in text.split(",") if name.strip())
  unknown = [name for name in names if name not in LIBRARIES]
  if not names or unknown:
    raise argparse.ArgumentTypeError(
        f"{text!r}: name one or more of {', '.join(LIBRARIES)}")
  return names


if __name__ == "__main__":
  main()
