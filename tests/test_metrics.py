"""Tests for openmoe_jax.metrics: JSON lines, TensorBoard events, progress lines."""
import glob
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax import metrics


def _tensorboard_scalars(model_dir):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  found = {}
  for path in glob.glob(os.path.join(model_dir, "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        number = value.simple_value if value.HasField("simple_value") else float(
            tf.make_ndarray(value.tensor))
        found[(value.tag, event.step)] = number
  return found


def test_jsonl_and_tensorboard(tmp_path):
  model_dir = str(tmp_path / "run")
  with metrics.MetricsLogger(model_dir) as logger:
    row = logger.write(10, {"train/loss": jnp.float32(2.5),
                            "train/tokens_per_sec": np.float64(1234.5),
                            "moe/drop_fraction": 0.125})
    logger.write(20, {"train/loss": jnp.asarray([1.5]), "eval/loss": 1.75})
  assert row == {"step": 10, "train/loss": 2.5, "train/tokens_per_sec": 1234.5,
                 "moe/drop_fraction": 0.125}

  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == [
      row, {"step": 20, "train/loss": 1.5, "eval/loss": 1.75}]

  scalars = _tensorboard_scalars(model_dir)
  assert scalars[("train/loss", 10)] == pytest.approx(2.5)
  assert scalars[("train/loss", 20)] == pytest.approx(1.5)
  assert scalars[("moe/drop_fraction", 10)] == pytest.approx(0.125)


def test_jsonl_appends_across_loggers_and_rejects_arrays(tmp_path):
  for step in (1, 2):
    with metrics.MetricsLogger(str(tmp_path)) as logger:
      logger.write(step, {"train/loss": float(step)})
      with pytest.raises(ValueError):
        logger.write(step, {"train/loss": np.ones(3)})
  steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2]


def test_non_chief_writes_no_files(tmp_path):
  with metrics.MetricsLogger(str(tmp_path / "worker"), is_chief=False) as logger:
    logger.write(1, {"train/loss": 1.0})
  assert not (tmp_path / "worker").exists()


def test_format_hms():
  assert metrics.format_hms(0) == "0:00:00"
  assert metrics.format_hms(3725.4) == "1:02:05"
  assert metrics.format_hms(27 * 3600 + 189) == "27:03:09"
  assert (metrics.format_hms(3599), metrics.format_hms(3600)) == ("0:59:59", "1:00:00")
  assert metrics.format_hms(float("nan")) == "?:??:??"


def test_format_hms_clamps_negative_seconds_to_zero():
  """A negative time (an ETA once step passes total_steps) prints as 0:00:00,
  not as -1:59:53."""
  assert metrics.format_hms(-7) == "0:00:00"
  assert metrics.format_hms(-0.4) == "0:00:00"


def test_progress_printer_line_and_eta():
  now = [100.0]
  printed = []
  printer = metrics.ProgressPrinter(total_steps=1000, start_step=100,
                                    print_fn=printed.append, clock=lambda: now[0])
  now[0] += 90.0  # 0.9 s/step since start_step -> 720 s for the remaining 800.
  line = printer.update(200, loss=jnp.float32(3.14159), tokens_per_sec=12345.6)
  assert printed == [line]
  assert line == ("step  200/1000 | loss 3.1416 | 12,346 tok/s | "
                  "elapsed 0:01:30 | eta 0:12:00")
  assert printer.line(100).endswith("eta ?:??:??")
  now[0] += 2.0  # one step after the first line: 2 s/step for the 799 left
  assert printer.line(201).endswith("eta 0:26:38")


def test_progress_eta_leaves_out_the_first_windows_compilation():
  # The quickstart's shape: 300 steps, the first window of 10 steps takes 30 s
  # (compilation), then every 10 steps take 12 s.
  now = [0.0]
  printer = metrics.ProgressPrinter(total_steps=300, print_fn=lambda _: None,
                                    clock=lambda: now[0])
  now[0] = 30.0
  assert printer.update(10).endswith("eta 0:14:30")  # 290 x 3 s: nothing else known
  now[0] = 42.0
  # 280 steps at 1.2 s (the window after compilation), not at 42 / 20 = 2.1 s.
  assert printer.update(20).endswith("elapsed 0:00:42 | eta 0:05:36")
  now[0] = 54.0
  assert printer.update(30).endswith("eta 0:05:24")  # 270 x (24 s / 20 steps)
  assert printer.line(10).endswith("eta 0:26:06")  # not past the first line: since start


def test_drop_rows_after_keeps_earlier_rows_only(tmp_path):
  model_dir = str(tmp_path / "run")
  with metrics.MetricsLogger(model_dir) as logger:
    for step in (0, 1, 2, 3, 4):
      logger.write(step, {"train/loss": float(step)})
  with metrics.MetricsLogger(model_dir) as logger:  # a run resumed from step 2
    assert logger.drop_rows_after(2) == 2
    assert logger.drop_rows_after(2) == 0
    logger.write(3, {"train/loss": 30.0})
  rows = [json.loads(l) for l in open(os.path.join(model_dir, metrics.JSONL_NAME))]
  assert [(r["step"], r["train/loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0),
                                                          (3, 30.0)]


def test_only_the_chief_touches_metrics_jsonl_and_remote_stores_rewrite_it(tmp_path):
  model_dir = str(tmp_path / "run")
  path = os.path.join(model_dir, metrics.JSONL_NAME)
  with metrics.MetricsLogger(model_dir) as logger:
    assert logger.drop_rows_after(0) == 0  # no file yet
    for step in (0, 1, 2):
      logger.write(step, {"train/loss": float(step)})
  before = open(path).read()
  with metrics.MetricsLogger(model_dir, is_chief=False) as other:  # another host
    assert other.drop_rows_after(0) == 0
    other.write(5, {"train/loss": 5.0})
  assert open(path).read() == before
  # A store that cannot append (gs://) gets the whole file rewritten on each flush;
  # forced here on a local directory.
  with metrics.MetricsLogger(model_dir) as logger:
    logger._local = False  # pylint: disable=protected-access
    logger.write(3, {"train/loss": 3.0})
    logger.write(4, {"train/loss": 4.0})
    assert open(path).read() == before  # buffered until the flush
    logger.flush()
    logger.write(5, {"train/loss": 5.0})
  rows = [json.loads(l) for l in open(path)]
  assert [(r["step"], r["train/loss"]) for r in rows] == [(s, float(s)) for s in range(6)]


def test_a_local_row_is_on_disk_once_written_in_a_new_nested_directory(tmp_path):
  """A local metrics.jsonl gets each row at once (a killed run keeps every row
  written); MODEL_DIR may be several directories that do not exist yet."""
  model_dir = tmp_path / "runs" / "moe" / "1"
  with metrics.MetricsLogger(str(model_dir)) as logger:
    logger.write(7, {"train/loss": 1.0})
    rows = (model_dir / metrics.JSONL_NAME).read_text().splitlines()
    assert [json.loads(l) for l in rows] == [{"step": 7, "train/loss": 1.0}]


class _RemoteFile:
  """A metrics.jsonl in a store that cannot append (gs://): read_text and
  write_text only; open() on its name fails."""

  def __init__(self):
    self.text = None

  def exists(self):
    return self.text is not None

  def read_text(self):
    return self.text

  def write_text(self, text):
    self.text = text

  def __fspath__(self):
    return "gs://bucket/run/metrics.jsonl"


def test_a_remote_metrics_file_is_rewritten_whole_at_each_flush(tmp_path):
  with metrics.MetricsLogger(str(tmp_path)) as logger:
    remote = logger.jsonl_path = _RemoteFile()
    logger._local = False  # pylint: disable=protected-access
    logger.write(1, {"train/loss": 1.0})
    assert not remote.exists()  # buffered until the flush
    logger.flush()
    logger.write(2, {"train/loss": 2.0})
  assert remote.text == ('{"step": 1, "train/loss": 1.0}\n'
                         '{"step": 2, "train/loss": 2.0}\n')
