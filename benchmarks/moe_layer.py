"""MoE layer forward+backward per dispatcher vs the dense gated MLP of equal active FLOPs.

Usage: python benchmarks/moe_layer.py [--quick] [--json] [--rounds N] [--dispatchers a,b]
       python benchmarks/moe_layer.py --shapes "d,f,E,k,tokens;..." [--dispatchers a,b]
       python benchmarks/moe_layer.py --sweep [--json]   (scaling in tokens, E and top_k)

Each row times `jax.jit(value_and_grad)` of the MoE layer (router + dispatch +
experts + combine; swiglu experts) on one batch against a dense swiglu MLP of hidden
width top_k x expert d_ff on all tokens (the same useful FLOPs but the router's).
Method (benchmarks/timing.py): every path of a shape is compiled first, then each
dispatcher is timed in pairs with the dense baseline alone (dense, a, dense, a, ...;
`--rounds` pairs after `--warmup` untimed pairs), then the next dispatcher. Per
path: `ms` is the median of its per-pair times, `ms_min` / `ms_max` their spread
(`dense_ms*` the baseline's, from the same pairs); `ratio_to_dense` is the MEDIAN OF
THE PER-PAIR RATIOS (a load change during the run hits both sides of a pair, so it
cancels), `ratio_to_dense_min` / `_max` the spread of the per-pair ratios.
`peak_fraction` (`dense_peak_fraction`) is the path's achieved FLOP/s, from its
ANALYTIC useful FLOPs (`useful_flops`: 6 x tokens x matmul parameters a token goes
through, top_k experts + router for MoE, flops.py's convention; the capacity paths
count top_k although they drop some choices) over its median time, as a fraction of
the fastest of two matmul peaks measured in the same run, one at the start
(`peak_flops_start`) and one at the end (`peak_flops_end`) by
`flops.measured_matmul_peak_flops` in the benchmark's dtype. `compiled_flops` is
what XLA's cost analysis counts for the path (padding and one-hot dispatch included;
None where the backend reports none). The load average (1, 5, 15 min) at the start
and end goes in the header and in every JSON row: a ratio is only as good as the
machine was quiet. A ratio under 1 means the dense baseline is not the fastest dense
program, not that the MoE layer is free; the peak fraction tells which.
Peak bytes: temp + argument bytes of the compiled program (`memory_analysis()`).
The `experts_floor` row is not a dispatcher: it times the experts' products alone
on perfectly balanced rows (tokens x top_k / E each, no router, no dispatch, no
combine, one batched einsum per weight) against the same dense baseline. It is
the floor of any path that runs each expert's MLP as products of its own rows: a
dispatcher's ratio minus the floor's is what routing, data movement and imbalance
cost; the floor's own ratio above 1 is what this backend loses on products of
tokens x top_k / E rows against the dense MLP's one product of all tokens. The
`router_only` row (`RouterOnly`) times the router alone with capacity routing:
logits, gates, top-k and slots, forward and backward, no expert.
`capacity_factor` counts per routed choice (MaxText's convention: buffers hold cf x
tokens x top_k / E rows per expert; the library's `MoeConfig.capacity_factor_train`
is per token, so it gets cf x top_k); dropless rows have capacity_factor None and no
padding beyond the grouped matmul's tile. Rows are printed once the run (and the end
peak) is done; progress goes to stderr.

`--sweep` times the scaling instead, same method: tokens 1k -> 16k at (d 512, f 512,
E 64, k 2), then E 8 -> 256 at 4096 tokens (d 512, f 512, k 2), then top_k 1 -> 8
at (d 512, f 512, E 64, 4096 tokens); rows are named "tokens_sweep" /
"experts_sweep" / "top_k_sweep" (the dense baseline grows with top_k: its width is
top_k x f). After the rows come the growth laws (`growth_laws`): per sweep and
path, the exponent a of time ~ x^a and of peak memory ~ x^a between the sweep's
first and last point (JSON: objects with a "growth" key). Einsum rows whose one-hot
dispatch tensor would exceed `--max_einsum_elements` are skipped (a note goes to
stderr).
"""
import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import timing  # noqa: E402
from openmoe_jax import flops  # noqa: E402
from openmoe_jax.cli import environment, host_malloc  # noqa: E402
from openmoe_jax.config import MoeConfig  # noqa: E402
from openmoe_jax.layers.mlp import Mlp  # noqa: E402
from openmoe_jax.moe.dispatch import (AutoDispatcher, BlockDispatcher,  # noqa: E402
                                      EinsumDispatcher, RaggedDispatcher,
                                      SortDispatcher)
from openmoe_jax.moe.dispatch.base import ExpertWeights, expert_mlp  # noqa: E402
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
    "block_cf": (BlockDispatcher(), False),
    "block_dropless": (BlockDispatcher(), True),
    "auto": (AutoDispatcher(), False),
}
# Not a dispatcher: the experts' products alone, on perfectly balanced rows (no
# router, no dispatch, no combine), one batched product per weight: the floor of
# any dispatcher that runs each expert's MLP as its own products (`floor_problem`).
FLOOR = "experts_floor"
# Not a dispatcher either: the router alone (`RouterOnly`), fwd+bwd of its logits,
# gates, top-k and slots with capacity routing, no expert computed.
ROUTER = "router_only"
DEFAULT_DISPATCHERS = ("einsum", "sort", "ragged_padded_cf", "block_cf",
                       "ragged_padded_dropless", "block_dropless", FLOOR, ROUTER)
SWEEP_DISPATCHERS = ("einsum", "sort", "block_cf", "block_dropless", FLOOR)
SWEEP_BASE = (512, 512, 64, 2, 4096)  # (d_model, d_ff, experts, top_k, tokens)
SWEEP_TOKENS = (1024, 2048, 4096, 8192, 16384)  # at the base's E
SWEEP_EXPERTS = (8, 16, 32, 64, 128, 256)  # at the base's tokens
SWEEP_TOP_K = (1, 2, 4, 8)  # at the base's E and tokens
# The shape entry each sweep varies: (d_model, d_ff, experts, top_k, tokens).
SWEEP_AXES = {"tokens_sweep": 4, "experts_sweep": 2, "top_k_sweep": 3}


def sweep_shapes():
  """Returns [(config name, shape)] of the scaling sweep."""
  d, f, experts, k, tokens = SWEEP_BASE
  rows = [("tokens_sweep", (d, f, experts, k, t)) for t in SWEEP_TOKENS]
  rows += [("experts_sweep", (d, f, e, k, tokens)) for e in SWEEP_EXPERTS]
  return rows + [("top_k_sweep", (d, f, experts, top, tokens)) for top in SWEEP_TOP_K]


def _exponent(y0, y1, x0, x1) -> Optional[float]:
  """Returns a of y ~ x^a through (x0, y0) and (x1, y1); None without two
  distinct x or positive y."""
  if not (y0 and y1 and y0 > 0 and y1 > 0) or x0 == x1:
    return None
  return round(math.log(y1 / y0) / math.log(x1 / x0), 3)


def growth_laws(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """Returns one record per (sweep, path) of the sweep `rows`, dense included:
  the exponents a of time ~ x^a (`ms_exponent`, from the median ms) and of peak
  memory ~ x^a (`peak_bytes_exponent`) between the first and the last point the
  path was timed at (`from` / `to`: the swept value), in sweep and row order."""
  points: Dict[Any, List[Tuple[int, float, Optional[int]]]] = {}
  for row in rows:
    axis = SWEEP_AXES.get(row["config"])
    if axis is None:
      continue
    x = (row["d_model"], row["d_ff"], row["experts"], row["top_k"], row["tokens"])[axis]
    points.setdefault((row["config"], row["dispatcher"]), []).append(
        (x, row["ms"], row["peak_bytes"]))
    dense = points.setdefault((row["config"], "dense"), [])
    if not dense or dense[-1][0] != x:
      dense.append((x, row["dense_ms"], row["dense_peak_bytes"]))
  laws = []
  for (sweep, path), series in points.items():
    (x0, ms0, bytes0), (x1, ms1, bytes1) = series[0], series[-1]
    laws.append({"growth": sweep, "path": path, "from": x0, "to": x1,
                 "ms_exponent": _exponent(ms0, ms1, x0, x1),
                 "peak_bytes_exponent": _exponent(bytes0, bytes1, x0, x1)})
  return laws


def config_name(shape) -> str:
  """Returns the row name of a (d_model, d_ff, experts, top_k, tokens) shape."""
  d, f, experts, k, tokens = shape
  return f"d{d}_f{f}_e{experts}_k{k}_t{tokens}"


def parse_shapes(text: str):
  """Returns the shapes of "d,f,E,k,tokens;..." (argparse type of --shapes)."""
  shapes = timing.parse_shapes(text, ("d", "f", "E", "k", "tokens"))
  if any(shape[3] > shape[2] for shape in shapes):
    raise argparse.ArgumentTypeError(f"top_k k must be at most E, got {text!r}")
  return shapes


def einsum_elements(shape) -> int:
  """Returns s x E x C of the einsum path's one-hot dispatch tensor (one group)."""
  _, _, experts, top_k, tokens = shape
  capacity = max(int(round(CAPACITY_FACTOR * top_k * tokens / experts)), 1)
  return tokens * experts * capacity


def _inputs(d_model: int, tokens: int, dtype: Any = jnp.float32):
  """Returns (x [1, tokens, d], cotangent of the same shape) in `dtype`."""
  x_btd = jax.random.normal(jax.random.PRNGKey(0), (1, tokens, d_model), dtype)
  ct_btd = jax.random.normal(jax.random.PRNGKey(1), (1, tokens, d_model), dtype)
  return x_btd, ct_btd


def _fwd_bwd(module, **kwargs):
  """Returns loss_and_grads(params, x, ct) of sum(module(x) * ct)."""
  def loss(params, x_btd, ct_btd):
    y = module.apply(params, x_btd, **kwargs)
    y_btd = y[0] if isinstance(y, tuple) else y
    return jnp.sum(y_btd.astype(jnp.float32) * ct_btd.astype(jnp.float32))
  return jax.value_and_grad(loss, argnums=(0, 1))


def dense_problem(shape, dtype: Any = jnp.float32):
  """Returns (loss_and_grads, params, x, ct) of the dense swiglu MLP of width
  top_k x d_ff (float32 parameters, `dtype` compute and inputs)."""
  d_model, d_ff, _, top_k, tokens = shape
  x_btd, ct_btd = _inputs(d_model, tokens, dtype)
  mlp = Mlp("swiglu", top_k * d_ff, dtype=dtype)
  params = nn.unbox(mlp.init(jax.random.PRNGKey(2), x_btd))
  return _fwd_bwd(mlp), params, x_btd, ct_btd


@dataclasses.dataclass(frozen=True)
class RouterOnly:
  """A dispatcher that runs no expert: y = x x (sum of the token's kept gates), so
  the router's forward and backward run and nothing else (the `ROUTER` row)."""

  def __call__(self, x_gsd, routing, weights):
    del weights
    gates_gs1 = jnp.sum(routing.gates, axis=-1, keepdims=True)
    return x_gsd * gates_gs1.astype(x_gsd.dtype)


def moe_problem(shape, dispatcher: str, dtype: Any = jnp.float32):
  """Returns (loss_and_grads, params, x, ct) of the MoE layer of `shape` with
  `dispatcher` (or `ROUTER`): one group of all tokens, train mode, `dtype` compute
  and inputs. For `ROUTER` only the router's gradient is returned (the unused
  experts' gradient would be zeros; jit drops it instead of writing it)."""
  d_model, d_ff, experts, top_k, tokens = shape
  engine, dropless = ((RouterOnly(), False) if dispatcher == ROUTER
                      else DISPATCHERS[dispatcher])
  cf = None if dropless else CAPACITY_FACTOR
  router = TokenChoiceRouter(dropless=dropless)
  cfg = MoeConfig(num_experts=experts, top_k=top_k, group_size=tokens,
                  capacity_factor_train=(cf or 1.0) * top_k, min_capacity=1,
                  router=router, dispatcher=engine)
  x_btd, ct_btd = _inputs(d_model, tokens, dtype)
  layer = MoeLayer(cfg, "swiglu", d_ff, dtype=dtype)
  params = nn.unbox(layer.init(jax.random.PRNGKey(2), x_btd, train=True))
  full = _fwd_bwd(layer, train=True)
  if dispatcher != ROUTER:
    return full, params, x_btd, ct_btd

  def router_grads(params, x_btd, ct_btd):
    value, (grads, dx_btd) = full(params, x_btd, ct_btd)
    return value, (grads["params"]["router"], dx_btd)

  return router_grads, params, x_btd, ct_btd


def floor_problem(shape, dtype: Any = jnp.float32):
  """Returns (loss_and_grads, weights, x, ct) of the `FLOOR` path: E swiglu experts
  of width d_ff, each on exactly tokens x top_k / E rows of its own ([E, r, d]
  inputs and cotangent), through `expert_mlp` (one batched einsum per weight):
  the same useful FLOPs as the dense MLP, none of the routing's work or imbalance."""
  d_model, d_ff, experts, top_k, tokens = shape
  if tokens * top_k % experts:
    raise ValueError(f"{FLOOR}: tokens x top_k = {tokens * top_k} is not a multiple "
                     f"of E = {experts}")
  rows = tokens * top_k // experts
  keys = jax.random.split(jax.random.PRNGKey(3), 5)
  normal = lambda key, shape, fan_in: (jax.random.normal(key, shape, jnp.float32)
                                       * fan_in ** -0.5)
  weights = ExpertWeights(
      wi_0=normal(keys[0], (experts, d_model, d_ff), d_model).astype(dtype),
      wi_1=normal(keys[1], (experts, d_model, d_ff), d_model).astype(dtype),
      wo=normal(keys[2], (experts, d_ff, d_model), d_ff).astype(dtype), kind="swiglu")
  x_end = jax.random.normal(keys[3], (experts, rows, d_model), dtype)
  ct_end = jax.random.normal(keys[4], (experts, rows, d_model), dtype)

  def loss(weights, x_end, ct_end):
    y_end = expert_mlp(weights, x_end)
    return jnp.sum(y_end.astype(jnp.float32) * ct_end.astype(jnp.float32))

  return jax.value_and_grad(loss, argnums=(0, 1)), weights, x_end, ct_end


def useful_flops(shape, dense: bool, experts: bool = True) -> float:
  """Returns the analytic fwd+bwd FLOPs of one step (flops.py's convention, 6 per
  matmul parameter per token): the dense MLP of width top_k x d_ff, or top_k
  experts of width d_ff plus the d x E router per token (the router alone without
  `experts`)."""
  d_model, d_ff, num_experts, top_k, tokens = shape
  if dense:
    return 6.0 * tokens * flops.mlp_matmul_params("swiglu", d_model, top_k * d_ff)
  per_token = (top_k * flops.mlp_matmul_params("swiglu", d_model, d_ff) * experts
               + d_model * num_experts)
  return 6.0 * tokens * per_token


def _same_tree(a, b) -> bool:
  """Returns whether two pytrees have the same structure and leaf shapes."""
  shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
  return (jax.tree.structure(a) == jax.tree.structure(b)
          and shapes(a) == shapes(b))


def compile_paths(shape, dispatchers: Sequence[str], dtype: Any = jnp.float32):
  """Returns {path: (call, peak bytes, compiled FLOPs)}, "dense" first then each
  dispatcher: `call()` runs that path's compiled fwd+bwd once. MoE paths with the
  same parameter shapes share one copy (same init key: same values)."""
  fn, params, x_btd, ct_btd = dense_problem(shape, dtype)
  compiled, peak, counted = timing.compile_fn(fn, params, x_btd, ct_btd)
  paths = {"dense": (lambda c=compiled, p=params: c(p, x_btd, ct_btd), peak, counted)}
  shared = None
  for dispatcher in dispatchers:
    if dispatcher == FLOOR:
      fn, weights, x_end, ct_end = floor_problem(shape, dtype)
      compiled, peak, counted = timing.compile_fn(fn, weights, x_end, ct_end)
      paths[FLOOR] = (lambda c=compiled: c(weights, x_end, ct_end), peak, counted)
      continue
    fn, params, _, _ = moe_problem(shape, dispatcher, dtype)
    if shared is not None and _same_tree(shared, params):
      params = shared
    shared = params
    compiled, peak, counted = timing.compile_fn(fn, params, x_btd, ct_btd)
    paths[dispatcher] = (lambda c=compiled, p=params: c(p, x_btd, ct_btd), peak,
                         counted)
  return paths


def time_shape(config: str, shape, dispatchers: Sequence[str], rounds: int = 5,
               warmup: int = 1, dtype: Any = jnp.float32,
               min_sample_ms: float = 0.0) -> List[Dict[str, Any]]:
  """Returns one row per dispatcher for `shape`, all paths and the dense baseline
  timed in pairs with dense (module docstring; `min_sample_ms`: timing.paired_ms);
  rows lack the run-wide fields that `finish_rows` adds (peaks, peak fractions,
  load averages)."""
  d_model, d_ff, experts, top_k, tokens = shape
  paths = compile_paths(shape, dispatchers, dtype)
  times = timing.paired_ms(paths["dense"][0],
                           {k: v[0] for k, v in paths.items() if k != "dense"},
                           rounds, warmup, min_sample_ms)
  rows = []
  for dispatcher, (dense, ms) in times.items():
    floor, router = dispatcher == FLOOR, dispatcher == ROUTER
    cf = (None if floor or (not router and DISPATCHERS[dispatcher][1])
          else CAPACITY_FACTOR)
    ratios = timing.per_round_ratios(ms, dense)
    rows.append({
        "config": config, "dispatcher": dispatcher, "tokens": tokens,
        "experts": experts, "top_k": top_k, "d_model": d_model, "d_ff": d_ff,
        "capacity_factor": cf, "dtype": jnp.dtype(dtype).name, "rounds": rounds,
        **timing.spread(ms, "ms"), **timing.spread(dense, "dense_ms"),
        **timing.spread(ratios, "ratio_to_dense"),
        "useful_flops": useful_flops(shape, dense=floor, experts=not router),
        "dense_useful_flops": useful_flops(shape, dense=True),
        "flops_source": "analytic",
        "compiled_flops": paths[dispatcher][2],
        "dense_compiled_flops": paths["dense"][2],
        "peak_bytes": paths[dispatcher][1],
        "dense_peak_bytes": paths["dense"][1],
    })
  return rows


def finish_rows(rows: List[Dict[str, Any]], peak_start: float, peak_end: float,
                load_start: Optional[List[float]],
                load_end: Optional[List[float]]) -> List[Dict[str, Any]]:
  """Returns `rows` with the run's matmul peaks and load averages and each path's
  achieved FLOP/s as a fraction of the higher peak."""
  peak = max(peak_start, peak_end)
  for row in rows:
    row.update({
        "peak_fraction": round(timing.peak_fraction(
            row["useful_flops"], row["ms"], peak), 4),
        "dense_peak_fraction": round(timing.peak_fraction(
            row["dense_useful_flops"], row["dense_ms"], peak), 4),
        "peak_flops_start": peak_start, "peak_flops_end": peak_end,
        "loadavg_start": load_start, "loadavg_end": load_end})
  return rows


def _print_row(row, as_json: bool):
  """Prints one result row as JSON or as a table line."""
  if as_json:
    print(json.dumps(row), flush=True)
    return
  peak = row["peak_bytes"] / 2**20 if row["peak_bytes"] else float("nan")
  print(f"{row['config']:20} {row['dispatcher']:24} {row['tokens']:6d} "
        f"{row['experts']:4d} {row['top_k']:3d} {str(row['capacity_factor']):>5} "
        f"{row['ms']:9.2f} [{row['ms_min']:.0f}-{row['ms_max']:.0f}] "
        f"{row['dense_ms']:9.2f} {row['ratio_to_dense']:6.2f} "
        f"[{row['ratio_to_dense_min']:.2f}-{row['ratio_to_dense_max']:.2f}] "
        f"{row['peak_fraction']:6.1%} {row['dense_peak_fraction']:6.1%} {peak:9.1f}",
        flush=True)


def _exponent_text(a: Optional[float]) -> str:
  return "-" if a is None else f"{a:.2f}"


def _print_growth(laws: List[Dict[str, Any]], as_json: bool):
  """Prints the sweep's growth laws as JSON objects or as a table."""
  if not as_json:
    print(f"# growth laws: time ~ x^a and peak memory ~ x^a between each sweep's first "
          f"and last point\n{'sweep':14} {'path':16} {'x':>11} {'a (time)':>9} "
          f"{'a (memory)':>10}")
  for law in laws:
    if as_json:
      print(json.dumps(law), flush=True)
      continue
    print(f"{law['growth']:14} {law['path']:16} {law['from']:>5}-{law['to']:<5} "
          f"{_exponent_text(law['ms_exponent']):>9} "
          f"{_exponent_text(law['peak_bytes_exponent']):>10}", flush=True)


def _header(peak_start: float, peak_end: float, load_start, load_end, rounds: int,
            dtype: Any) -> str:
  """Returns the table's header lines (run conditions, then column names)."""
  return (f"# {jax.devices()[0].device_kind}, {jnp.dtype(dtype).name}, {rounds} "
          f"pairs with dense per path; matmul peak {peak_start / 1e9:.1f} GFLOP/s at start, "
          f"{peak_end / 1e9:.1f} at end; load average {load_start} at start, "
          f"{load_end} at end\n"
          f"{'config':20} {'dispatcher':24} {'tokens':>6} {'E':>4} {'k':>3} {'cf':>5} "
          f"{'ms [min-max]':>15} {'dense_ms':>9} {'ratio [min-max]':>18} "
          f"{'%peak':>6} {'dense%':>6} {'peak_MiB':>9}")


def run(shapes, dispatchers: Sequence[str], rounds: int, warmup: int,
        max_einsum_elements: int, dtype: Any = jnp.float32):
  """Returns (rows, run info dict): every shape timed in pairs with dense between a start
  and an end matmul peak and load average."""
  load_start, peak_start = timing.load_average(), timing.matmul_peak(dtype)
  rows = []
  for config, shape in shapes:
    chosen = []
    for dispatcher in dispatchers:
      if dispatcher == "einsum" and einsum_elements(shape) > max_einsum_elements:
        print(f"skip einsum at {config} {shape}: dispatch tensor of "
              f"{einsum_elements(shape)} elements", file=sys.stderr)
        continue
      if dispatcher == FLOOR and shape[4] * shape[3] % shape[2]:
        print(f"skip {FLOOR} at {config} {shape}: tokens x top_k is not a multiple "
              "of E (its experts get equal rows)", file=sys.stderr)
        continue
      chosen.append(dispatcher)
    print(f"timing {config} {shape}: dense, {', '.join(chosen)}", file=sys.stderr,
          flush=True)
    rows += time_shape(config, shape, chosen, rounds, warmup, dtype)
  peak_end, load_end = timing.matmul_peak(dtype), timing.load_average()
  info = {"peak_flops_start": peak_start, "peak_flops_end": peak_end,
          "loadavg_start": load_start, "loadavg_end": load_end}
  return finish_rows(rows, peak_start, peak_end, load_start, load_end), info


def main(argv=None):
  # The allocator setting of the library's CPU programs (openmoe_jax/cli/
  # host_malloc.py), before the first computation: freed buffers are reused
  # instead of page-faulted in again on every call.
  if environment.runs_on_cpu():
    print(f"malloc: reuse freed memory {host_malloc.reuse_freed_memory()} "
          "(OPENMOE_MALLOC=default: glibc's defaults)", file=sys.stderr)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help=f"{QUICK_TOKENS} tokens")
  parser.add_argument("--sweep", action="store_true",
                      help="scaling sweep: tokens 1k-16k, E 8-256, top_k 1-8")
  parser.add_argument("--json", action="store_true", help="one JSON object per row")
  parser.add_argument("--rounds", "--runs", dest="rounds", type=int, default=5,
                      help="timed pairs (dense, path) per path (--runs: the old name)")
  parser.add_argument("--warmup", type=int, default=1, help="untimed rounds")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--configs", default=",".join(CONFIGS),
                      help=f"named configs, from {sorted(CONFIGS)}")
  parser.add_argument("--shapes", type=parse_shapes, default=None,
                      help='your own shapes instead of --configs: "d,f,E,k,tokens;..." '
                      "(d_model, expert d_ff, experts, top_k, tokens)")
  parser.add_argument("--dispatchers", default=None,
                      help=f"from {sorted(DISPATCHERS) + [FLOOR, ROUTER]}")
  parser.add_argument("--max_einsum_elements", type=int, default=1 << 28)
  args = parser.parse_args(argv)
  unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
  if unknown:
    parser.error(f"--configs: unknown {unknown}; one of {sorted(CONFIGS)}")
  if args.sweep:
    shapes = sweep_shapes()
    dispatchers = args.dispatchers or ",".join(SWEEP_DISPATCHERS)
  else:
    shapes = ([(None, shape) for shape in args.shapes] if args.shapes
              else [(c, CONFIGS[c]) for c in args.configs.split(",")])
    if args.quick:
      shapes = [(name, shape[:4] + (QUICK_TOKENS,)) for name, shape in shapes]
    shapes = [(name or config_name(shape), shape) for name, shape in shapes]
    dispatchers = args.dispatchers or ",".join(DEFAULT_DISPATCHERS)
  rows, info = run(shapes, dispatchers.split(","), args.rounds, args.warmup,
                   args.max_einsum_elements, jnp.dtype(args.dtype))
  if not args.json:
    print(_header(info["peak_flops_start"], info["peak_flops_end"],
                  info["loadavg_start"], info["loadavg_end"], args.rounds, args.dtype))
  for row in rows:
    _print_row(row, args.json)
  if args.sweep:
    _print_growth(growth_laws(rows), args.json)


if __name__ == "__main__":
  main()
