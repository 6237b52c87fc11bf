"""Timing helpers shared by the benchmarks: compile once, time paths interleaved.

The method (issue #15): every path of one comparison (the dense baseline first, then
each MoE path) is compiled up front, then timed in rounds, one call of each path per
round in the same order (dense, a, b, ..., dense, a, b, ...). Load that drifts over
the run hits all paths of a round alike, so each path's ratio to the baseline is
taken per round and its median reported, next to the median and spread (min, max)
of each path's per-round times. Beside the ratio goes the achieved FLOP/s as a
fraction of a matmul peak measured in the same process (`flops.measured_matmul_
peak_flops`), and the load average, so a reader can tell a busy machine's numbers.
"""
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from openmoe_jax import flops


def load_average() -> Optional[List[float]]:
  """Returns the 1, 5 and 15 minute load averages (None where the OS has none)."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def matmul_peak(dtype: Any) -> float:
  """Returns the measured matmul peak FLOP/s of device 0 in `dtype`: the fastest
  4096-wide matmul on an accelerator, 1024-wide on CPU."""
  size = 1024 if jax.devices()[0].platform == "cpu" else 4096
  return flops.measured_matmul_peak_flops(jnp.dtype(dtype), size)


def compile_fn(fn: Callable, *args) -> Tuple[Callable, Optional[int], Optional[float]]:
  """Returns (compiled jit(fn) for `args`, temp + argument bytes, FLOPs XLA's cost
  analysis counts; None where the backend reports none)."""
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  peak = None if mem is None else int(mem.temp_size_in_bytes
                                      + mem.argument_size_in_bytes)
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else None
  counted = None if not cost or "flops" not in cost else float(cost["flops"])
  return compiled, peak, counted


def interleaved_ms(calls: Dict[str, Callable[[], Any]], rounds: int,
                   warmup: int = 1) -> Dict[str, List[float]]:
  """Returns {name: [ms of round 0, 1, ...]}: `warmup` untimed calls of each, then
  `rounds` rounds calling every entry of `calls` once, in order."""
  for _ in range(warmup):
    for call in calls.values():
      jax.block_until_ready(call())
  times: Dict[str, List[float]] = {name: [] for name in calls}
  for _ in range(rounds):
    for name, call in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(call())
      times[name].append((time.perf_counter() - start) * 1e3)
  return times


def spread(values: Sequence[float], prefix: str, digits: int = 3) -> Dict[str, float]:
  """Returns {prefix: median, prefix_min: min, prefix_max: max} of `values`."""
  return {prefix: round(statistics.median(values), digits),
          f"{prefix}_min": round(min(values), digits),
          f"{prefix}_max": round(max(values), digits)}


def per_round_ratios(times: Sequence[float], base: Sequence[float]) -> List[float]:
  """Returns times[r] / base[r] for each round r."""
  return [t / b for t, b in zip(times, base)]


def peak_fraction(flop: float, ms: float, peak_flops: float) -> float:
  """Returns the fraction of `peak_flops` achieved by `flop` FLOPs in `ms` ms."""
  return flop / (ms * 1e-3) / peak_flops
