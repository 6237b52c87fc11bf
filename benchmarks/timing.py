"""Timing helpers shared by the benchmarks: compile once, time paths in pairs.

The method (issue #15): every path of one comparison (the dense baseline and each
MoE path) is compiled up front, then each MoE path is timed against the baseline
alone, alternating one call of each (A B A B ..., `rounds` pairs after `warmup`
untimed pairs). Load that drifts over the run hits both calls of a pair alike, so
the path's ratio to the baseline is taken per pair and its median reported, next to
the median and spread (min, max) of both sides' times. Pairing each path with the
baseline alone (rather than one round through every path) keeps one path's working
set (a 2 GiB one-hot tensor, say) from evicting the caches the next path starts
with. Beside the ratio goes the achieved FLOP/s as a fraction of a matmul peak
measured in the same process (`flops.measured_matmul_peak_flops`), and the load
average, so a reader can tell a busy machine's numbers.

On an accelerator one call of a small path lasts less than launching it from Python
(a 4096-token MoE layer on a GPU: ~0.2 ms of work). There `min_sample_ms` makes each
timed sample `repeat` calls back to back, the last one waited for, divided by
`repeat`: the device queues the calls, so a sample times the work, not the launch.
"""
import argparse
import math
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from openmoe_jax import flops


def load_average() -> Optional[List[float]]:
  """Returns the 1, 5 and 15 minute load averages (None where the OS has none)."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def matmul_peak(dtype: Any) -> float:
  """Returns the measured matmul peak FLOP/s of device 0 in `dtype`, with the
  trainer's calibration matmul (`flops.calibration_matmul`: 1024-wide on CPU, 5
  back-to-back 8192-wide ones a rep elsewhere)."""
  size, calls = flops.calibration_matmul(jax.devices()[0])
  return flops.measured_matmul_peak_flops(jnp.dtype(dtype), size, calls=calls)


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


def call_ms(call: Callable[[], Any], repeat: int = 1) -> float:
  """Returns the milliseconds of one call of `call`: `repeat` calls back to back,
  the last one's results waited for, the time divided by `repeat`."""
  start = time.perf_counter()
  for _ in range(repeat - 1):
    call()
  jax.block_until_ready(call())
  return (time.perf_counter() - start) * 1e3 / repeat


def repeats_for(call: Callable[[], Any], min_sample_ms: float) -> int:
  """Returns how many back-to-back calls of `call` last `min_sample_ms` (one call
  timed to tell); 1 when `min_sample_ms` is 0, without calling."""
  if min_sample_ms <= 0:
    return 1
  return max(1, math.ceil(min_sample_ms / max(call_ms(call), 1e-3)))


def paired_ms(base: Callable[[], Any], calls: Dict[str, Callable[[], Any]],
              rounds: int, warmup: int = 1, min_sample_ms: float = 0.0
              ) -> Dict[str, Tuple[List[float], List[float]]]:
  """Returns {name: (base ms per pair, name's ms per pair)}: for each entry of
  `calls` in turn, `warmup` untimed then `rounds` timed pairs (base, call), each
  side's sample `repeats_for(side, min_sample_ms)` calls long (module docstring)."""
  times = {}
  for name, call in calls.items():
    for _ in range(warmup):
      jax.block_until_ready(base())
      jax.block_until_ready(call())
    base_repeat = repeats_for(base, min_sample_ms)
    call_repeat = repeats_for(call, min_sample_ms)
    pairs = [(call_ms(base, base_repeat), call_ms(call, call_repeat))
             for _ in range(rounds)]
    times[name] = ([b for b, _ in pairs], [c for _, c in pairs])
  return times


def spread(values: Sequence[float], prefix: str, digits: int = 3) -> Dict[str, float]:
  """Returns {prefix: median, prefix_min: min, prefix_max: max} of `values`."""
  return {prefix: round(statistics.median(values), digits),
          f"{prefix}_min": round(min(values), digits),
          f"{prefix}_max": round(max(values), digits)}


def per_round_ratios(times: Sequence[float], base: Sequence[float]) -> List[float]:
  """Returns times[r] / base[r] for each round (pair) r."""
  return [t / b for t, b in zip(times, base)]


def peak_fraction(flop: float, ms: float, peak_flops: float) -> float:
  """Returns the fraction of `peak_flops` achieved by `flop` FLOPs in `ms` ms."""
  return flop / (ms * 1e-3) / peak_flops


def parse_shapes(text: str, fields: Sequence[str]) -> List[Tuple[int, ...]]:
  """Returns the shapes of "a,b,...;a,b,..." (an argparse `type`): each shape has
  one positive integer per name in `fields`."""
  usage = ",".join(fields)
  try:
    shapes = [tuple(int(v) for v in item.split(",")) for item in text.split(";")]
  except ValueError:
    shapes = None
  if not shapes or any(len(s) != len(fields) or min(s) < 1 for s in shapes):
    raise argparse.ArgumentTypeError(
        f"each shape is {usage} (positive integers), shapes separated by ';'; "
        f"got {text!r}")
  return shapes


def synthetic_batch(vocab_size: int, batch_size: int, length: int) -> Dict[str, Any]:
  """Returns a causal LM batch of random tokens (one segment per row, every target
  counts)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, vocab_size, size=(batch_size, length)).astype(np.int32)
  return {"decoder_input_tokens": tokens,
          "decoder_target_tokens": np.roll(tokens, -1, 1),
          "decoder_loss_weights": np.ones((batch_size, length), np.int32),
          "decoder_segment_ids": np.ones((batch_size, length), np.int32),
          "decoder_positions": np.broadcast_to(
              np.arange(length, dtype=np.int32), (batch_size, length)).copy()}
