"""The step loop of a training run: periodic logging, evaluation, checkpoints, and
stopping cleanly on SIGTERM (preemption) or Ctrl-C.

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
from typing import Any, Callable, Dict, Iterator

import jax
import numpy as np

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


def _mean_metrics(history) -> Dict[str, float]:
  fetched = jax.device_get(history)
  return {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}


class TrainLoop:
  """Runs the steps with periodic logging, evaluation and checkpoints.

  `stage_for_step(step)` returns the LoopStage that runs training step `step`;
  `checkpointer` saves the state (`save`, `latest_step`, `directory`); `logger`
  writes metric rows (`write(step, scalars)`).
  """

  def __init__(self, stage_for_step: Callable[[int], LoopStage], checkpointer, logger,
               print_fn: Callable[[str], None], tokens_per_batch: int):
    self.stage_for_step = stage_for_step
    self.ckpt, self.logger, self.print_fn = checkpointer, logger, print_fn
    self.tokens_per_batch = tokens_per_batch
    self.summary: Dict[str, Any] = {}
    self.steady_tokens_per_sec, self.all_tokens_per_sec = [], []

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
    means = _mean_metrics(history)
    tokens_per_sec = len(history) * self.tokens_per_batch / (
        time.perf_counter() - window_start)
    self.all_tokens_per_sec.append(tokens_per_sec)
    if not compiled_in_window:
      self.steady_tokens_per_sec.append(tokens_per_sec)
    # Routing statistics of training batches go under "moe/", as TensorBoard groups.
    scalars = {k if k.startswith("moe/") else f"train/{k}": v
               for k, v in means.items()}
    scalars["train/tokens_per_sec"] = tokens_per_sec
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
        self.ckpt.save(final_step, state, {"train_batches": final_step}, force=True)
    self.summary["final_step"] = final_step
    self.summary["preempted"] = bool(stop)
    self.summary["interrupted"] = "SIGINT" in stop
    if stop:
      how = "Ctrl-C" if "SIGINT" in stop else stop[0]
      self.print_fn(f"{how}: stopped after step {final_step}; checkpoint saved in "
                    f"{self.ckpt.directory}/{final_step}. Run the same command again "
                    "to resume from it.")
    # Windows that included compilation count only when no other window exists.
    rates = self.steady_tokens_per_sec or self.all_tokens_per_sec
    self.summary["tokens_per_sec"] = float(np.mean(rates)) if rates else None
    return self.summary

  def _steps(self, state, start, train_steps, eval_every, log_every, progress, stop):
    """Runs the steps until train_steps or a stop signal; returns the last state.

    At most one step waits in the device queue behind the one running, so a
    signal is acted on after the step in flight, not after a queue of them.
    """
    history, window_start, previous = [], time.perf_counter(), None
    for step in range(start + 1, train_steps + 1):
      stage = self.stage_for_step(step)
      state, metrics = stage.train_step(state, next(stage.batches))
      history.append(metrics)
      if previous is not None:
        jax.block_until_ready(previous)
      previous = metrics
      if step % log_every == 0 or step == train_steps or (stop and history):
        self.log(step, history, window_start,
                 compiled_in_window=step - len(history) == start, progress=progress)
        history, window_start = [], time.perf_counter()
      # The last step's checkpoint is forced here, so that it is written while the
      # final evaluation runs rather than after it.
      self.ckpt.save(step, state, {"train_batches": step},
                     force=step == train_steps or bool(stop))
      if stop:
        break
      if step % eval_every == 0 or step == train_steps:
        if step == train_steps:
          self.print_fn(f"Final evaluation at step {step} ...")
        self.evaluate(step, state.params)
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
