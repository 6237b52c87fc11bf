"""Run OpenMoE 2 ablation arms side by side and tabulate them.

  openmoe-ablate [--arms=tc_softmax,ec_batch,...] [--steps=100] [--output=DIR]
                 [--run_gin=runs/ablate_tiny.gin] [--gin.NAME=VALUE ...] [--json]

Each arm is a gin file under gin/experiments/openmoe2/ (default: all of them, the
`dense` reference and the `upcycled` arm included). Every arm trains with the same
run file, steps and seed, in MODEL_DIR = <output>/<arm>; the `upcycled` arm first
needs the `dense` arm's checkpoint, so the dense arm is trained before it (it is
upcycled with openmoe-upcycle, then trained the same number of steps; its row
therefore saw twice the data and compute of the others). The table has one row per
arm: validation loss at the end, the drop fraction and expert-load coefficient of
variation of the last training log window, and steady-state tokens/s. With --json,
one JSON object per arm is printed instead (progress goes to stderr). The command
line is cli/ablate.py.
"""
import dataclasses
import math
import os
import time
from typing import Callable, List, Optional, Sequence, Tuple

import gin

from openmoe_jax import gin_utils
from openmoe_jax.trainer import train
from openmoe_jax.upcycle import upcycle

ARMS_DIR = "experiments/openmoe2"
# Arm -> the arm whose final checkpoint it is upcycled from.
UPCYCLED_FROM = {"upcycled": "dense"}


def available_arms() -> List[str]:
  """Returns the arm names: the gin files of ARMS_DIR except the shared tiny_base."""
  folder = os.path.join(gin_utils.gin_config_dir(), ARMS_DIR)
  return sorted(name[:-4] for name in os.listdir(folder)
                if name.endswith(".gin") and name != "tiny_base.gin")


@dataclasses.dataclass
class ArmResult:
  """One table row."""

  arm: str
  steps: int
  first_val_loss: float
  val_loss: float
  train_loss: float
  drop_fraction: Optional[float]  # None for a model without MoE layers
  expert_load_cv: Optional[float]
  tokens_per_sec: float
  seconds: float
  note: str = ""


def _configure(run_gin: str, arm: str, model_dir: str, steps: int,
               bindings: Sequence[str]) -> List[str]:
  """Parses the arm's gin config (cleared first); returns its gin files."""
  files = [run_gin, f"{ARMS_DIR}/{arm}.gin"]
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(files, [f"MODEL_DIR = '{model_dir}'", f"TRAIN_STEPS = {steps}",
                              *bindings], finalize=False)
  return files


def run_arm(arm: str, steps: int, output: str, run_gin: str,
            bindings: Sequence[str] = (), print_fn: Callable = print) -> ArmResult:
  """Trains one arm for `steps` steps in <output>/<arm>; returns its row.

  An arm in UPCYCLED_FROM is upcycled from <output>/<source>, which must exist.
  """
  model_dir = os.path.join(output, arm)
  if os.path.exists(os.path.join(model_dir, "checkpoints")):
    raise FileExistsError(f"{model_dir} already holds a run; pick a new --output or "
                          "delete it (arms always train from scratch)")
  note = ""
  if arm in UPCYCLED_FROM:
    source = os.path.join(output, UPCYCLED_FROM[arm])
    files = _configure(run_gin, arm, model_dir, steps, bindings)
    upcycle(source, model_dir, files, [f"MODEL_DIR = '{model_dir}'",
                                       f"TRAIN_STEPS = {steps}", *bindings],
            print_fn=print_fn)
    note = f"from {UPCYCLED_FROM[arm]} @ its last step"
  _configure(run_gin, arm, model_dir, steps, bindings)
  gin_utils.check_required(train)
  start = time.perf_counter()
  summary = train(print_fn=print_fn)
  seconds = time.perf_counter() - start
  train_metrics = summary.get("last_train_metrics", {})
  return ArmResult(
      arm=arm, steps=summary["final_step"], first_val_loss=summary["first_eval_loss"],
      val_loss=summary["last_eval_loss"], train_loss=summary.get("last_train_ce_loss",
                                                                 math.nan),
      drop_fraction=train_metrics.get("moe/drop_fraction"),
      expert_load_cv=train_metrics.get("moe/expert_load_cv"),
      tokens_per_sec=summary["tokens_per_sec"] or math.nan, seconds=seconds, note=note)


def run_arms(arms: Sequence[str], steps: int, output: str, run_gin: str,
             bindings: Sequence[str] = (), print_fn: Callable = print,
             on_result: Callable[[ArmResult], None] = lambda r: None
             ) -> List[ArmResult]:
  """Trains `arms` in order (an upcycled arm's source first); returns their rows."""
  known = available_arms()
  unknown = [a for a in arms if a not in known]
  if unknown:
    raise ValueError(f"unknown arms {unknown}; available: {', '.join(known)}")
  order = list(arms)
  for arm, source in UPCYCLED_FROM.items():
    if arm in order and source not in order[:order.index(arm)]:
      if source in order:
        order.remove(source)
      order.insert(order.index(arm), source)
  # A source arm that was not asked for and already ran (same output) is reused.
  order = [a for a in order if a in arms or not os.path.exists(
      os.path.join(output, a, "checkpoints"))]
  results = {}
  for i, arm in enumerate(order):
    print_fn(f"=== arm {i + 1}/{len(order)}: {arm} ({steps} steps) ===")
    prefixed = lambda line, arm=arm: print_fn(f"[{arm}] {line}")
    results[arm] = run_arm(arm, steps, output, run_gin, bindings, prefixed)
    if arm in arms:
      on_result(results[arm])
  return [results[arm] for arm in arms]


def _fmt(value: Optional[float], spec: str) -> str:
  return "-" if value is None else format(value, spec)


def format_table(results: Sequence[ArmResult]) -> str:
  """Returns the results as an aligned text table."""
  header = (f"{'arm':<18} {'steps':>5} {'val loss':>9} {'(start)':>8} {'drop frac':>9} "
            f"{'load CV':>8} {'tok/s':>8}  note")
  lines = [header, "-" * len(header)]
  for r in results:
    lines.append(
        f"{r.arm:<18} {r.steps:>5} {r.val_loss:>9.4f} {r.first_val_loss:>8.4f} "
        f"{_fmt(r.drop_fraction, '.3f'):>9} {_fmt(r.expert_load_cv, '.3f'):>8} "
        f"{r.tokens_per_sec:>8.0f}  {r.note}")
  return "\n".join(lines)


WARMUP = "adamw_warmup_cosine.warmup_steps"


def short_run_bindings(run_gin: str, steps: int, bindings: Sequence[str] = ()
                       ) -> Tuple[List[str], Optional[str]]:
  """Returns (bindings, note): when the run file's warmup is not shorter than
  `steps`, the bindings gain a warmup of max(1, steps // 10) and the note says so;
  otherwise `bindings` unchanged and None."""
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin([run_gin], [f"TRAIN_STEPS = {steps}", *bindings],
                      finalize=False)
  try:
    warmup = gin.query_parameter(WARMUP)
  except ValueError:  # the run file uses another optimizer
    return list(bindings), None
  if not isinstance(warmup, int) or warmup < steps:
    return list(bindings), None
  short = max(1, steps // 10)
  if short >= steps:
    raise ValueError(f"--steps={steps} is too short: train at least 2 steps")
  note = (f"--steps={steps} is not longer than the warmup of {run_gin} ({warmup} "
          f"steps): warming up for {short} step(s) instead ({WARMUP}={short})")
  return [*bindings, f"{WARMUP} = {short}"], note
