"""The step loop of a training run: periodic logging, evaluation, checkpoints,
stopping cleanly on SIGTERM (preemption) or Ctrl-C, and stopping after too many
consecutive skipped (non-finite) steps.

The loop knows nothing of models or meshes: for each step it asks for the `LoopStage`
running it (a train step, an evaluation and the stage's batches); trainer.py builds
them from gin.
"""
import contextlib
import dataclasses
import os
import signal
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional

import jax
import numpy as np

from openmoe_jax import errors
from openmoe_jax.metrics import ProgressPrinter


@dataclasses.dataclass(frozen=True)
class LoopStage:
  """What the loop needs of the training stage that runs a step."""

  # (state, host-local batch) -> (new state, scalar device metrics).
  train_step: Callable[[Any, Dict[str, np.ndarray]], Any]
  # params -> evaluation metrics (floats; at least ce_loss and accuracy).
  evaluate: Callable[[Any], Dict[str, float]]
  # The stage's training batches, already positioned where the run resumes.
  batches: Iterator[Dict[str, np.ndarray]]


SKIPPED = "skipped_steps"  # per-step metric of the train step: 1.0 when skipped


class TrainingDivergedError(errors.RunError):
  """Too many consecutive steps had a non-finite loss or gradient norm.

  `step`: the last skipped step; `checkpoint_step`: the newest checkpoint on disk
  (None when there is none)."""

  def __init__(self, message: str, step: int, checkpoint_step):
    super().__init__(message)
    self.step, self.checkpoint_step = step, checkpoint_step


def _mean_metrics(fetched) -> Dict[str, float]:
  """Returns the mean of each metric over the steps of a window that were not
  skipped (all steps when every one was), and the window's count of skipped steps
  under SKIPPED."""
  kept = [m for m in fetched if not m.get(SKIPPED, 0.0)] or fetched
  means = {k: float(np.mean([m[k] for m in kept])) for k in fetched[0]}
  if SKIPPED in fetched[0]:
    means[SKIPPED] = float(sum(m[SKIPPED] for m in fetched))
  return means


class TrainLoop:
  """Runs the steps with periodic logging, evaluation and checkpoints.

  `stage_for_step(step)` returns the LoopStage that runs training step `step`;
  `checkpointer` saves the state (`save`, `latest_step`, `directory`); `logger`
  writes metric rows (`write(step, scalars)`).

  Steps the train step skipped (metric SKIPPED, a non-finite loss or gradient
  norm) are counted: per log window (`train/skipped_steps`) and since the run's
  first step (`train/skipped_steps_total`, starting from `skipped_steps`, the count
  stored with the checkpoint resumed from; saved in the data position).
  `max_consecutive_skipped` (None: no limit) of them in a row raise
  TrainingDivergedError naming the steps and the newest checkpoint on disk.

  `steps_before_data`: steps the state counts that drew no batch from this run's
  data (a run started from a params export of step S: S); the data position saved
  with the checkpoint of step n is n - steps_before_data batches.

  `mfu_meter` (a flops.MfuMeter, or None) adds `train/mfu` and the FLOPs per token to
  each log window and the MFU of the summary's tokens_per_sec as `summary["mfu"]`.
  A measured peak is measured again after each evaluation (outside the timed
  windows) and the highest reading kept: each window's `train/mfu` uses the
  highest so far, the summary the highest of the run (`mfu_peak_gflops`).
  """

  def __init__(self, stage_for_step: Callable[[int], LoopStage], checkpointer, logger,
               print_fn: Callable[[str], None], tokens_per_batch: int,
               max_consecutive_skipped: Optional[int] = None, skipped_steps: int = 0,
               mfu_meter: Any = None, steps_before_data: int = 0):
    self.stage_for_step = stage_for_step
    self.steps_before_data = steps_before_data
    self.mfu_meter = mfu_meter
    self.ckpt, self.logger, self.print_fn = checkpointer, logger, print_fn
    self.tokens_per_batch = tokens_per_batch
    self.summary: Dict[str, Any] = {}
    self.steady_tokens_per_sec, self.all_tokens_per_sec = [], []
    self.max_consecutive_skipped = max_consecutive_skipped
    self.skipped_total, self.consecutive_skipped = int(skipped_steps), 0
    self._accounted = None  # the last step whose skip flag was read

  def _account(self, step: int, metrics) -> None:
    """Reads whether `step` (metrics: its device or host metrics) was skipped and
    updates the counts, once per step, in step order."""
    if SKIPPED not in metrics or (self._accounted is not None
                                  and step <= self._accounted):
      return
    self._accounted = step
    fetched = jax.device_get(metrics)
    if not fetched[SKIPPED]:
      self.consecutive_skipped = 0
      return
    self.skipped_total += 1
    self.consecutive_skipped += 1
    self.print_fn(f"step {step}: loss {float(fetched.get('loss', np.nan))}, gradient "
                  f"norm {float(fetched.get('grad_norm', np.nan))}: not finite, update "
                  f"skipped ({self.consecutive_skipped} in a row)")

  def _position(self, step: int) -> Dict[str, int]:
    """Returns the data position saved with the checkpoint of `step`."""
    return {"train_batches": step - self.steps_before_data, SKIPPED: self.skipped_total}

  def _check_diverged(self, step: int) -> None:
    """Raises TrainingDivergedError when the consecutive skips reached the limit."""
    limit = self.max_consecutive_skipped
    if not limit or self.consecutive_skipped < limit:
      return
    wait = getattr(self.ckpt, "wait_until_finished", None)
    if wait is not None:
      wait()
    latest = self.ckpt.latest_step()
    first = step - self.consecutive_skipped + 1
    where = (f"the newest checkpoint on disk is {self.ckpt.directory}/{latest}, "
             f"whose parameters are those after step {min(latest, first - 1)}"
             if latest is not None
             else "no checkpoint was saved")
    raise TrainingDivergedError(
        f"stopping at step {step}: {self.consecutive_skipped} consecutive steps "
        f"({first} to {step}) had a non-finite loss or gradient norm and were skipped "
        f"(train.max_consecutive_skipped_steps = {limit}); {where}. Lower the learning "
        "rate or check the data, then relaunch.", step, latest)

  def evaluate(self, step, params, write=True):
    """Prints (and, if `write`, logs) validation metrics at `step`."""
    metrics = self.stage_for_step(step).evaluate(params)
    if write:
      self.logger.write(step, {f"eval/{k}": v for k, v in metrics.items()})
    self.summary.setdefault("first_eval_ce_loss", metrics["ce_loss"])
    self.summary["last_eval_ce_loss"] = metrics["ce_loss"]
    # Older names of the two values above, kept for scripts reading the summary.
    self.summary["first_eval_loss"] = self.summary["first_eval_ce_loss"]
    self.summary["last_eval_loss"] = metrics["ce_loss"]
    self.summary["last_eval_metrics"] = metrics
    self.print_fn(f"eval @ step {step}: ce_loss {metrics['ce_loss']:.4f} "
                  f"accuracy {metrics['accuracy']:.3f} "
                  f"drop_fraction {metrics.get('moe/drop_fraction', 0.0):.3f}")

  def log(self, step, history, window_start, compiled_in_window, progress):
    """Writes the mean metrics of the steps in `history` and a progress line."""
    # Fetching the metrics waits for the window's steps (dispatch is asynchronous),
    # so the clock is read after it.
    fetched = jax.device_get(history)
    for i, metrics in enumerate(fetched):
      self._account(step - len(fetched) + 1 + i, metrics)
    means = _mean_metrics(fetched)
    tokens_per_sec = len(history) * self.tokens_per_batch / (
        time.perf_counter() - window_start)
    self.all_tokens_per_sec.append(tokens_per_sec)
    if not compiled_in_window:
      self.steady_tokens_per_sec.append(tokens_per_sec)
    # Routing statistics of training batches go under "moe/", as TensorBoard groups.
    scalars = {k if k.startswith("moe/") else f"train/{k}": v
               for k, v in means.items()}
    scalars["train/tokens_per_sec"] = tokens_per_sec
    if self.mfu_meter is not None:
      scalars.update(self.mfu_meter.scalars(tokens_per_sec))
    if SKIPPED in means:
      scalars["train/skipped_steps_total"] = float(self.skipped_total)
    self.logger.write(step, scalars)
    # `loss` everywhere (progress line, summary, metrics.jsonl) is the objective's
    # total: cross-entropy plus the auxiliary (router, z) losses; `ce_loss` is the
    # cross-entropy alone, the number evaluation reports.
    progress.update(step, scalars["train/loss"], tokens_per_sec)
    self.summary["last_train_loss"] = scalars["train/loss"]
    self.summary["last_train_ce_loss"] = scalars["train/ce_loss"]
    self.summary["last_train_metrics"] = scalars

  def run(self, state, train_steps, eval_every, log_every) -> Dict[str, Any]:
    """Trains from state.step to train_steps; returns the run summary."""
    start = int(state.step)
    self.summary["start_step"] = start
    if start == 0 or start >= train_steps:
      # A resumed run with nothing left evaluates again without a second row.
      self.evaluate(start, state.params, write=start == 0)
    progress = ProgressPrinter(train_steps, start, print_fn=self.print_fn)
    with stop_signals() as stop:
      state = self._steps(state, start, train_steps, eval_every, log_every, progress,
                          stop)
      final_step = int(state.step)
      if self.ckpt.latest_step() != final_step:
        self.ckpt.save(final_step, state, self._position(final_step), force=True)
    self.summary["final_step"] = final_step
    self.summary["preempted"] = bool(stop)
    self.summary["interrupted"] = "SIGINT" in stop
    if stop:
      how = "Ctrl-C" if "SIGINT" in stop else stop[0]
      self.print_fn(f"{how}: stopped after step {final_step}; checkpoint saved in "
                    f"{self.ckpt.directory}/{final_step}. Run the same command again "
                    "to resume from it.")
    self.summary.update(self._throughput())
    return self.summary

  def _recalibrate(self) -> None:
    """Measures the MFU peak again (a measured one) and says when it rose."""
    if self.mfu_meter is not None and self.mfu_meter.recalibrate():
      self.print_fn(f"MFU peak: {self.mfu_meter.peak_flops_per_sec / 1e9:.1f} "
                    "GFLOP/s per device, measured again (the highest reading counts)")

  def _throughput(self) -> Dict[str, Any]:
    """Returns the summary's throughput: `tokens_per_sec`, the mean of the log
    windows' rates, and their median, min and max (`tokens_per_sec_median`, ...:
    on a shared machine a few windows slowed by other work pull the mean down,
    the median shows the typical window); `mfu` and `mfu_median` of the mean and
    the median with an MFU meter, and `mfu_peak_gflops`, the peak they divide by.
    Windows that included compilation count only when no other window exists.
    All None when no step ran."""
    rates = self.steady_tokens_per_sec or self.all_tokens_per_sec
    stats = {"tokens_per_sec": np.mean, "tokens_per_sec_median": np.median,
             "tokens_per_sec_min": np.min, "tokens_per_sec_max": np.max}
    result = {k: float(fn(rates)) if rates else None for k, fn in stats.items()}
    if self.mfu_meter is not None:
      for key, rate_key in (("mfu", "tokens_per_sec"),
                            ("mfu_median", "tokens_per_sec_median")):
        rate = result[rate_key]
        result[key] = None if rate is None else self.mfu_meter.mfu(rate)
      result["mfu_peak_gflops"] = self.mfu_meter.peak_flops_per_sec / 1e9
    return result

  def _steps(self, state, start, train_steps, eval_every, log_every, progress, stop):
    """Runs the steps until train_steps or a stop signal; returns the last state.

    At most one step waits in the device queue behind the one running, so a
    signal is acted on after the step in flight, not after a queue of them.
    """
    history, window_start, previous = [], time.perf_counter(), None
    is_due = getattr(self.ckpt, "is_save_due", lambda step: True)
    for step in range(start + 1, train_steps + 1):
      stage = self.stage_for_step(step)
      state, metrics = stage.train_step(state, next(stage.batches))
      history.append(metrics)
      if previous is not None:
        jax.block_until_ready(previous[1])
        self._account(*previous)
        self._check_diverged(previous[0])
      previous = (step, metrics)
      if step % log_every == 0 or step == train_steps or (stop and history):
        self.log(step, history, window_start,
                 compiled_in_window=step - len(history) == start, progress=progress)
        history, window_start = [], time.perf_counter()
        self._check_diverged(step)
      # The last step's checkpoint is forced here, so that it is written while the
      # final evaluation runs rather than after it.
      force = step == train_steps or bool(stop)
      if force or is_due(step):
        self._account(step, metrics)  # the skip count saved is exact
      self.ckpt.save(step, state, self._position(step), force=force)
      if stop:
        break
      if step % eval_every == 0 or step == train_steps:
        if step == train_steps:
          self.print_fn(f"Final evaluation at step {step} ...")
        self.evaluate(step, state.params)
        self._recalibrate()
        window_start = time.perf_counter()
    return state


@contextlib.contextmanager
def stop_signals(signals=(signal.SIGTERM, signal.SIGINT)):
  """Yields a list that receives the name of each stop signal that arrives
  ("SIGTERM": TPU VMs get one before maintenance or preemption; "SIGINT": Ctrl-C).

  The loop stops after the step in flight. After a first SIGINT, Ctrl-C gets its
  default action back: a second one kills the process at once. Previous handlers
  are restored on exit. Off the main thread no handler can be installed and the
  list stays empty.
  """
  flag = []
  if threading.current_thread() is not threading.main_thread():
    yield flag
    return

  def on_signal(signum, frame):
    del frame
    name = signal.Signals(signum).name
    flag.append(name)
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.SIG_DFL)
      # os.write: safe inside a handler, where print could meet a half-done print.
      os.write(2, b"\nCtrl-C: finishing the step in flight, then saving a checkpoint"
               b" (press Ctrl-C again to abort at once, without it)\n")

  previous = {s: signal.signal(s, on_signal) for s in signals}
  try:
    yield flag
  finally:
    for s, handler in previous.items():
      if not (s == signal.SIGINT and "SIGINT" in flag):  # keep: 2nd Ctrl-C kills
        signal.signal(s, handler)
