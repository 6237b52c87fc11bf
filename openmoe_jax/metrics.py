"""Scalar metrics to TensorBoard and JSON lines, and console progress lines.

Metric names carry their group: "train/loss", "eval/loss", "train/tokens_per_sec",
"train/learning_rate", "moe/drop_fraction", ...
"""
import json
import os
import sys
import time
from collections.abc import Callable, Mapping

import numpy as np
from etils import epath

JSONL_NAME = "metrics.jsonl"


def to_float(value) -> float:
  """Returns a python float from a python/numpy/jax scalar (or size-1 array)."""
  array = np.asarray(value)
  if array.size != 1:
    raise ValueError(f"expected a scalar, got shape {array.shape}")
  return float(array.reshape(()))


def _row_step(line: str, default: int) -> int:
  """Returns the step of a metrics.jsonl row, `default` for a line that is not one
  (the torn last line of a process killed while writing it)."""
  try:
    return int(json.loads(line).get("step", 0))
  except (ValueError, AttributeError):
    return default


class MetricsLogger:
  """Writes scalars to TensorBoard event files and `<model_dir>/metrics.jsonl`.

  Only the chief process writes files; other processes log through absl only.
  Each `write` appends one JSON object per line: {"step": 10, "train/loss": 2.3, ...}.
  Non-finite values are written as NaN/Infinity (python's json extension).
  """

  def __init__(self, model_dir: str, is_chief: bool = True):
    self.model_dir = epath.Path(model_dir)
    self.is_chief = is_chief
    self.jsonl_path = self.model_dir / JSONL_NAME
    # clu's writers bring TensorFlow: imported by a logger, not by `import trainer`.
    from clu import metric_writers  # pylint: disable=g-import-not-at-top
    if is_chief:
      self.model_dir.mkdir(parents=True, exist_ok=True)
      self._writer = metric_writers.create_default_writer(os.fspath(self.model_dir))
    else:
      self._writer = metric_writers.create_default_writer(just_logging=True)
    self._pending: list[str] = []
    self._local = "://" not in os.fspath(self.jsonl_path)

  def drop_rows_after(self, step: int) -> int:
    """Removes the rows of steps after `step` from metrics.jsonl (a resumed run
    writes those steps again), and a row cut short by a killed process; returns
    how many rows were removed."""
    if not self.is_chief or not self.jsonl_path.exists():
      return 0
    lines = [l for l in self.jsonl_path.read_text().splitlines() if l.strip()]
    kept = [l for l in lines if _row_step(l, default=step + 1) <= step]
    if len(kept) != len(lines):
      self.jsonl_path.write_text("".join(l + "\n" for l in kept))
    return len(lines) - len(kept)

  def write(self, step: int, scalars: Mapping[str, float]) -> dict:
    """Records `scalars` at `step`; returns the row written ({"step": ..., name: float})."""
    row = {"step": int(step), **{k: to_float(v) for k, v in scalars.items()}}
    self._writer.write_scalars(int(step), {k: v for k, v in row.items() if k != "step"})
    if self.is_chief:
      self._pending.append(json.dumps(row))
      if self._local:
        self._append_pending()
    return row

  def flush(self) -> None:
    """Pushes buffered scalars to TensorBoard and the JSON-lines file."""
    self._writer.flush()
    self._append_pending()

  def _append_pending(self) -> None:
    if not self._pending:
      return
    text = "".join(line + "\n" for line in self._pending)
    if self._local:
      with open(os.fspath(self.jsonl_path), "a") as f:
        f.write(text)
    else:
      # Remote stores (gs://) cannot append: rewrite this small file, on flush only.
      old = self.jsonl_path.read_text() if self.jsonl_path.exists() else ""
      self.jsonl_path.write_text(old + text)
    self._pending.clear()

  def close(self) -> None:
    """Flushes and closes the writers."""
    self.flush()
    self._writer.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def format_hms(seconds: float) -> str:
  """Returns `seconds` as 'h:mm:ss' (hours unbounded, e.g. '27:03:09')."""
  if not np.isfinite(seconds):
    return "?:??:??"
  s = max(0, int(round(seconds)))
  return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ProgressPrinter:
  """Prints one console line per call: step/total, loss, tokens/s, elapsed, ETA.

  Elapsed counts from construction (start_step). The ETA extrapolates the mean
  speed since the first printed line, so the first window's compilation (or a
  restore) does not inflate every later ETA; the first line itself, with nothing
  after compilation to go on yet, extrapolates the mean speed since start_step.
  """

  def __init__(self, total_steps: int, start_step: int = 0,
               print_fn: Callable[[str], None] | None = None,
               clock: Callable[[], float] = time.monotonic):
    self.total_steps = total_steps
    self.start_step = start_step
    self._print = print_fn or (lambda line: print(line, file=sys.stdout, flush=True))
    self._clock = clock
    self._start_time = clock()
    self._first_line = None  # (step, time) of the first printed line

  def line(self, step: int, loss: float | None = None,
           tokens_per_sec: float | None = None) -> str:
    """Returns the progress line for `step` without printing it."""
    now = self._clock()
    elapsed = now - self._start_time
    from_step, from_time = self.start_step, self._start_time
    if self._first_line is not None and step > self._first_line[0]:
      from_step, from_time = self._first_line
    done = step - from_step
    eta = ((self.total_steps - step) * (now - from_time) / done if done > 0
           else float("nan"))
    width = len(str(self.total_steps))
    parts = [f"step {step:>{width}}/{self.total_steps}"]
    if loss is not None:
      parts.append(f"loss {to_float(loss):.4f}")
    if tokens_per_sec is not None:
      parts.append(f"{to_float(tokens_per_sec):,.0f} tok/s")
    parts += [f"elapsed {format_hms(elapsed)}", f"eta {format_hms(eta)}"]
    return " | ".join(parts)

  def update(self, step: int, loss: float | None = None,
             tokens_per_sec: float | None = None) -> str:
    """Prints and returns the progress line for `step`."""
    text = self.line(step, loss, tokens_per_sec)
    self._print(text)
    if self._first_line is None:
      self._first_line = (step, self._clock())
    return text
