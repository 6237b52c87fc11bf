"""Faults injected into real training runs (issue 14, trainer side): storage and
data checks before any compile, a damaged latest checkpoint, a changed model on
resume, NaN/Inf steps, and kill -9 mid-step and mid-save.

In-process runs go through the gin `train()` as the command line does; the kill -9
runs are subprocesses of TRAIN_MODULE.
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from run_files import logged_losses, tree_digest

from openmoe_jax import checkpoints, gin_utils, train_loop, trainer
from openmoe_jax.data import pipeline
from openmoe_jax.metrics import MetricsLogger
from openmoe_jax.objectives import CausalLm
from openmoe_jax.train_loop import TrainingDivergedError
from openmoe_jax.trainer import train

TRAIN_MODULE = "openmoe_jax.cli.train"

TINY_BINDINGS = [
    "ModelConfig.d_model = 32", "ModelConfig.num_heads = 2", "ModelConfig.head_dim = 16",
    "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 2", "MoeConfig.num_experts = 4",
    "MoeConfig.group_size = 64", "SEQUENCE_LENGTH = 64", "BATCH_SIZE = 8",
    "train.eval_batches = 1", "train.log_every_steps = 1",
    "train.eval_every_steps = 1000", "adamw_warmup_cosine.warmup_steps = 1",
    "adamw_warmup_cosine.total_steps = 20",
]


def _configure(model_dir, steps, extra=()):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/quickstart.gin"],
                      TINY_BINDINGS + [f"MODEL_DIR = '{model_dir}'",
                                       f"TRAIN_STEPS = {steps}"] + list(extra))


def _rows(model_dir):
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _train_losses(model_dir):
  return {r["step"]: r["train/loss"] for r in _rows(model_dir) if "train/loss" in r}


def _truncate_array_data(step_dir):
  path = max(glob.glob(os.path.join(step_dir, "state", "d", "*")), key=os.path.getsize)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _no_compile(monkeypatch):
  """Makes building the Trainer (the first step towards compiling) fail loudly."""
  def compile_(*args, **kwargs):
    raise AssertionError("the Trainer was built: the check came too late")
  monkeypatch.setattr(trainer, "Trainer", compile_)


# -- before any compile -------------------------------------------------------------

def test_unwritable_model_dir_fails_before_compile(tmp_path, monkeypatch):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  _configure(blocker / "run", 2)
  _no_compile(monkeypatch)
  with pytest.raises(checkpoints.UnwritableDirectoryError, match="not writable"):
    train(print_fn=lambda *_: None)


def test_missing_eval_data_file_fails_before_compile(tmp_path, monkeypatch):
  (tmp_path / "train.jsonl").write_text(json.dumps({"text": "some words"}) + "\n")
  missing = tmp_path / "validation.jsonl"
  patterns = {"train": str(tmp_path / "train.jsonl"), "validation": str(missing)}
  _configure(tmp_path / "run", 2, [
      "MIXTURE_OR_TASK_NAME = 'reliab_files'",
      "register_tasks.file_tasks = [@reliab_files/source_task]",
      "reliab_files/source_task.name = 'reliab_files'",
      "reliab_files/source_task.source = @reliab_files/text_files()",
      f"reliab_files/text_files.split_to_filepattern = {patterns!r}"])
  _no_compile(monkeypatch)
  with pytest.raises(pipeline.DataFileError, match="validation.jsonl"):
    train(print_fn=lambda *_: None)


@pytest.mark.parametrize("starts", [(1,), (0, 3, 3), (0, 5, 2)])
def test_stages_that_do_not_start_at_zero_and_increase_fail_before_compile(
    tmp_path, monkeypatch, starts):
  _configure(tmp_path / "run", 2)
  _no_compile(monkeypatch)
  stages = tuple(trainer.Stage(start, "local_mix") for start in starts)
  with pytest.raises(ValueError, match="train.stages must start at step 0 and increase"):
    train(stages=stages, print_fn=lambda *_: None)
  assert not (tmp_path / "run").exists()


# -- damaged checkpoints, changed configuration ---------------------------------------

@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
  """Returns (model dir, {step: train loss}) of a run of 3 steps that saved a
  checkpoint after each."""
  model_dir = str(tmp_path_factory.mktemp("three") / "run")
  _configure(model_dir, 3, ["train.checkpoint_every_steps = 1",
                            "train.keep_checkpoints = 5"])
  train(print_fn=lambda *_: None)
  gin.clear_config()
  return model_dir, _train_losses(model_dir)


def _copy(three_steps, tmp_path):
  model_dir = str(tmp_path / "run")
  shutil.copytree(three_steps[0], model_dir)
  return model_dir


def test_damaged_latest_checkpoint_resumes_from_previous_with_same_losses(
    three_steps, tmp_path):
  model_dir = _copy(three_steps, tmp_path)
  _truncate_array_data(os.path.join(model_dir, "checkpoints", "3"))
  partial = os.path.join(model_dir, "checkpoints", "4.orbax-checkpoint-tmp-1234")
  os.makedirs(os.path.join(partial, "state"))
  _configure(model_dir, 3, ["train.checkpoint_every_steps = 1",
                            "train.keep_checkpoints = 5"])
  lines = []
  summary = train(print_fn=lines.append)
  text = "\n".join(lines)
  assert f"Checkpoint {model_dir}/checkpoints/3 is damaged" in text, text
  assert "Falling back to the checkpoint of step 2" in text
  assert f"Removed {partial}" in text and not os.path.exists(partial)
  assert summary["start_step"] == 2 and summary["final_step"] == 3
  assert os.path.isdir(os.path.join(model_dir, checkpoints.DAMAGED_DIR, "3"))
  # Step 3 ran again from step 2's parameters and data position: the same loss.
  assert _train_losses(model_dir) == three_steps[1]


def test_a_fresh_start_drops_every_row_of_the_earlier_run(three_steps, tmp_path):
  """Checkpoints deleted, metrics.jsonl kept: the run starts at step 0 and repeats
  every step, so no row of the earlier run stays, not even its step-0 evaluation."""
  model_dir = _copy(three_steps, tmp_path)
  old_rows = _rows(model_dir)
  assert sum(r["step"] == 0 for r in old_rows) == 1  # the first evaluation
  shutil.rmtree(os.path.join(model_dir, "checkpoints"))
  _configure(model_dir, 1)
  lines = []
  assert train(print_fn=lines.append)["start_step"] == 0
  assert f"Dropped {len(old_rows)} metrics.jsonl row(s) past step 0" in "\n".join(lines)
  steps = [r["step"] for r in _rows(model_dir)]
  assert steps.count(0) == 1 and set(steps) == {0, 1}, steps

def test_a_finished_run_launched_again_trains_nothing_and_keeps_its_rows(three_steps,
                                                                          tmp_path):
  model_dir = _copy(three_steps, tmp_path)
  rows = _rows(model_dir)
  _configure(model_dir, 3, ["train.checkpoint_every_steps = 1",
                            "train.keep_checkpoints = 5"])
  lines = []
  summary = train(print_fn=lines.append)
  assert ("Nothing to train: the run is at step 3 and TRAIN_STEPS is 3 (raise "
          "--gin.TRAIN_STEPS to train further)") in lines
  assert (summary["start_step"], summary["final_step"]) == (3, 3)
  assert summary["tokens_per_sec"] is None  # no step ran
  assert [l for l in lines if l.startswith("eval @ step")] == [
      f"eval @ step 3: ce_loss {summary['last_eval_ce_loss']:.4f} "
      f"accuracy {summary['last_eval_metrics']['accuracy']:.3f} drop_fraction "
      f"{summary['last_eval_metrics']['moe/drop_fraction']:.3f}"]
  assert _rows(model_dir) == rows  # the evaluation is printed, not logged again
  # The restored parameters evaluate as they did at the end of the first launch.
  final_eval = [r for r in rows if "eval/ce_loss" in r][-1]
  assert final_eval["step"] == 3
  assert summary["last_eval_ce_loss"] == pytest.approx(final_eval["eval/ce_loss"],
                                                       rel=1e-6)


def test_restore_fallback_false_stops_and_changes_nothing(three_steps, tmp_path,
                                                           monkeypatch):
  model_dir = _copy(three_steps, tmp_path)
  _truncate_array_data(os.path.join(model_dir, "checkpoints", "3"))
  before = tree_digest(model_dir)
  _configure(model_dir, 4, ["train.restore_fallback = False"])
  monkeypatch.setattr(trainer.Trainer, "_compile_steps", lambda self: None)
  with pytest.raises(checkpoints.CheckpointDamagedError, match="checkpoints/3"):
    train(print_fn=lambda *_: None)
  assert tree_digest(model_dir) == before


@pytest.mark.parametrize("binding, saved, model", [
    ("ModelConfig.d_model = 48", "32", "48"),
    ("MoeConfig.num_experts = 8", "4", "8"),
    # A vocabulary of another size: the embedding (8192 tokens padded to 8320).
    ("ModelConfig.vocab_size = 8448", "8320", "8448"),
])
def test_changed_model_on_resume_is_one_clear_error_and_changes_nothing(
    three_steps, tmp_path, monkeypatch, binding, saved, model):
  model_dir = _copy(three_steps, tmp_path)
  before = tree_digest(model_dir)
  _configure(model_dir, 4, [binding])
  monkeypatch.setattr(trainer.Trainer, "_compile_steps", lambda self: None)
  with pytest.raises(checkpoints.CheckpointMismatchError) as error:
    train(print_fn=lambda *_: None)
  message = str(error.value)
  assert "does not fit the configured model" in message
  # The first mismatch named is a parameter, with both shapes.
  found = re.search(r"model: (params/\S+): checkpoint shape (\([^)]*\)), "
                    r"model shape (\([^)]*\))", message)
  assert found, message
  saved_shape, model_shape = found.group(2), found.group(3)
  assert saved in saved_shape and model in model_shape and saved_shape != model_shape
  assert isinstance(error.value, ValueError)  # the CLI's exit 2 without a traceback
  assert tree_digest(model_dir) == before


# -- NaN / Inf steps ------------------------------------------------------------------

MARKER = -1  # a token id no vocabulary has: the test objective's NaN trigger


class NanOnMarker:
  """Causal LM whose loss (and so every gradient) is NaN on batches holding MARKER."""

  def __init__(self):
    self.inner = CausalLm()

  def __call__(self, model, params, batch, rng, *, train):
    tokens = batch["decoder_input_tokens"]
    marked = jnp.any(tokens == MARKER)
    batch = dict(batch, decoder_input_tokens=jnp.maximum(tokens, 0))
    loss, metrics = self.inner(model, params, batch, rng, train=train)
    return loss * jnp.where(marked, jnp.nan, 1.0), metrics


def _mark_train_batches(monkeypatch, bad_steps):
  """Puts MARKER into the training batches of `bad_steps` (batch n feeds step n),
  where the trainer reads its data: each pass of `pipeline.sharded_passes`."""
  original = pipeline.sharded_passes

  def sharded_passes(*args, split="train", skip_batches=0, **kwargs):
    new_pass = original(*args, split=split, skip_batches=skip_batches, **kwargs)
    if split != "train":
      return new_pass
    def marked():
      for step, batch in enumerate(new_pass(), start=skip_batches + 1):
        if step in bad_steps:
          tokens = batch["decoder_input_tokens"].copy()
          tokens[0, 0] = MARKER
          batch = dict(batch, decoder_input_tokens=tokens)
        yield batch
    return marked
  monkeypatch.setattr(pipeline, "sharded_passes", sharded_passes)


def _restored(model_dir, step):
  with checkpoints.Checkpointer(model_dir) as ckpt:
    state, position = ckpt.restore(step=step)
  return jax.device_get(state), position


def _identical(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(leaves_a) == len(leaves_b) and all(
      np.asarray(x).tobytes() == np.asarray(y).tobytes()
      for x, y in zip(leaves_a, leaves_b))


def test_nan_steps_are_skipped_counted_and_too_many_stop_the_run(tmp_path,
                                                                  monkeypatch):
  model_dir = str(tmp_path / "run")
  _mark_train_batches(monkeypatch, {3, 5, 6})
  _configure(model_dir, 8, ["train.checkpoint_every_steps = 1",
                            "train.keep_checkpoints = None",
                            "train.max_consecutive_skipped_steps = 2"])
  lines = []
  with pytest.raises(TrainingDivergedError) as error:
    train(objective=NanOnMarker(), print_fn=lines.append)
  message = str(error.value)
  assert "stopping at step 6: 2 consecutive steps (5 to 6)" in message, message
  assert f"{model_dir}/checkpoints/5" in message and "after step 4" in message
  assert error.value.step == 6 and error.value.checkpoint_step == 5
  assert any("step 3: loss nan" in l and "update skipped" in l for l in lines)
  # A skipped step changes neither the parameters nor the optimizer state.
  states = {s: _restored(model_dir, s) for s in (2, 3, 4, 5)}
  for before, after in ((2, 3), (4, 5)):
    assert _identical(states[before][0]["params"], states[after][0]["params"])
    assert _identical(states[before][0]["opt_state"], states[after][0]["opt_state"])
    assert int(states[after][0]["step"]) == after  # the data moved on
  assert not _identical(states[3][0]["params"], states[4][0]["params"])
  assert [states[s][1] for s in (2, 3, 5)] == [
      {"train_batches": 2, "skipped_steps": 0}, {"train_batches": 3, "skipped_steps": 1},
      {"train_batches": 5, "skipped_steps": 2}]
  # Every checkpoint on disk is finite; the stop left no checkpoint of step 6.
  assert sorted(os.listdir(os.path.join(model_dir, "checkpoints"))) == [
      "1", "2", "3", "4", "5"]
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(states[5][0]))
  rows = {r["step"]: r for r in _rows(model_dir) if "train/loss" in r}
  assert [rows[s]["train/skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 0, 1, 1]
  assert [rows[s]["train/skipped_steps_total"] for s in range(1, 7)] == [
      0, 0, 1, 1, 2, 3]
  assert all(np.isfinite(rows[s]["train/loss"]) for s in (1, 2, 4))


def test_a_row_torn_by_a_killed_process_is_dropped_on_resume(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(
      '{"step": 1, "train/loss": 2.5}\n{"step": 2, "train/loss": 2.4}\n{"step": 3, "tr')
  logger = MetricsLogger(str(tmp_path), is_chief=True)
  try:
    assert logger.drop_rows_after(2) == 1
  finally:
    logger.close()
  assert _train_losses(str(tmp_path)) == {1: 2.5, 2: 2.4}


# -- kill -9 ------------------------------------------------------------------------

def _cli(model_dir, steps):
  args = ["--gin_file=runs/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
          f"--gin.TRAIN_STEPS={steps}", "--gin.train.checkpoint_every_steps=2",
          "--gin.train.keep_checkpoints=10"]
  return [sys.executable, "-m", TRAIN_MODULE] + args + [
      f"--gin.{b.replace(' ', '')}" for b in TINY_BINDINGS]


def _kill_when(proc, ready, timeout=300):
  """SIGKILLs `proc` as soon as `ready()` holds; returns the time it waited."""
  start = time.monotonic()
  while not ready():
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    assert time.monotonic() - start < timeout, "the run never got there"
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_kill_9_mid_save_and_mid_step_then_relaunch_loses_nothing(tmp_path):
  model_dir = str(tmp_path / "run")
  ckpt_dir = os.path.join(model_dir, "checkpoints")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  spawn = lambda steps, extra_env: subprocess.Popen(
      _cli(model_dir, steps), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, env=dict(env, **extra_env), cwd=str(tmp_path))
  listing = lambda: os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []

  # 1. Killed while the checkpoint of step 4 is being written (the save hook holds
  #    each save open for 5 s), after the one of step 2 was committed.
  first = spawn(1000, {checkpoints.DEBUG_SAVE_DELAY_ENV: "5"})
  _kill_when(first, lambda: "2" in listing() and any(
      n.startswith("4.") and checkpoints.TMP_MARKER in n for n in listing()))
  assert "4" not in listing()
  reference = logged_losses(model_dir)  # an uninterrupted run from step 0
  assert max(reference) >= 4, reference

  # 2. Relaunched: cleans the partial save, resumes from step 2; killed mid-step
  #    once it has run past its first checkpoint.
  second = spawn(1000, {})
  _kill_when(second, lambda: "6" in listing() and max(
      logged_losses(model_dir), default=0) >= 7)
  output = second.stdout.read()
  assert "orbax-checkpoint-tmp" in output and "Removed" in output, output[-3000:]
  assert "Resumed from step 2" in output, output[-3000:]
  resumed = logged_losses(model_dir)
  for step in range(3, max(reference) + 1):
    assert resumed[step] == reference[step], step  # bit for bit (JSON repr)
  reference.update(resumed)

  # 3. Relaunched again: resumes from its newest complete checkpoint and the steps
  #    it repeats give the same losses; the run then finishes.
  last = max(reference)
  third = subprocess.run(_cli(model_dir, last), capture_output=True, text=True,
                         env=env, cwd=str(tmp_path), timeout=600)
  assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
  restart = int(third.stdout.split("Resumed from step ", 1)[1].split()[0])
  assert 6 <= restart < last
  final = logged_losses(model_dir)
  assert set(final) == set(range(1, last + 1))
  assert all(final[s] == reference[s] for s in final), (final, reference)
  assert not any(checkpoints.TMP_MARKER in n for n in listing())


@jax.custom_vjp
def _blow_up_gradient(w, bad):
  """Identity on `w` whose gradient is infinite when `bad` > 0."""
  del bad
  return w


_blow_up_gradient.defvjp(
    lambda w, bad: (w, bad),
    lambda bad, g: (g * jnp.where(bad > 0, jnp.inf, 1.0), jnp.zeros_like(bad)))


def test_a_finite_loss_with_an_infinite_gradient_norm_is_skipped_too():
  def objective(model, params, batch, rng, *, train):
    del model, rng, train
    w = _blow_up_gradient(params["w"], batch["bad"][0])
    loss = jnp.sum(w ** 2)
    return loss, {"moe/aux_loss": jnp.float32(0.0), "num_tokens": jnp.float32(1.0)}
  optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
  step_fn = jax.jit(trainer.make_train_step(None, objective, optimizer))
  params = {"w": jnp.arange(4, dtype=jnp.float32)}
  state = trainer.TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  batch = lambda bad: {"decoder_loss_weights": jnp.ones((1, 4)),
                       "bad": jnp.full((1,), bad, jnp.float32)}
  good, metrics = step_fn(state, batch(0.0), jax.random.PRNGKey(0))
  assert float(metrics["skipped_steps"]) == 0.0
  assert not _identical(good.params, state.params)
  after, metrics = step_fn(good, batch(1.0), jax.random.PRNGKey(0))
  assert float(metrics["skipped_steps"]) == 1.0
  assert np.isfinite(float(metrics["loss"])) and not np.isfinite(float(metrics["grad_norm"]))
  assert _identical(after.params, good.params)
  assert _identical(after.opt_state, good.opt_state)
  assert int(after.step) == 2


def test_a_log_window_averages_its_finite_steps_and_counts_the_skipped_ones():
  """Window of 3 steps, the 2nd skipped (loss NaN): the logged loss is the mean of
  the other two, (2 + 4) / 2, and the window's skipped count is 1; a window of
  skipped steps only averages them all (nothing else to show)."""
  skipped = train_loop.SKIPPED
  means = train_loop._mean_metrics([  # pylint: disable=protected-access
      {"loss": 2.0, skipped: 0.0}, {"loss": float("nan"), skipped: 1.0},
      {"loss": 4.0, skipped: 0.0}])
  assert means == {"loss": 3.0, skipped: 1.0}
  only = train_loop._mean_metrics([  # pylint: disable=protected-access
      {"loss": 5.0, skipped: 1.0}, {"loss": 7.0, skipped: 1.0}])
  assert only == {"loss": 6.0, skipped: 2.0}


class _SavesInFlight:
  """A checkpointer whose saves land on disk only when waited for (Orbax's
  asynchronous saves); without `wait_until_finished` when `can_wait` is False."""

  directory = "/ckpt"

  def __init__(self, on_disk, in_flight, can_wait=True):
    self.on_disk, self.in_flight = on_disk, in_flight
    if can_wait:
      self.wait_until_finished = lambda: setattr(self, "on_disk", self.in_flight)

  def latest_step(self):
    return self.on_disk


@pytest.mark.parametrize("can_wait", [True, False])
def test_a_diverged_run_names_the_checkpoint_its_save_in_flight_lands_as(can_wait):
  """Steps 5 and 6 skipped (limit 2) while the save of step 5 is in flight: the
  error names checkpoint 5 once the save finished (parameters after step 4), not
  the 3 on disk when the limit was hit; a checkpointer that cannot wait names the
  newest on disk."""
  loop = train_loop.TrainLoop(lambda step: None, _SavesInFlight(3, 5, can_wait), None,
                              print, 1, max_consecutive_skipped=2)
  loop.consecutive_skipped = 2
  with pytest.raises(TrainingDivergedError) as error:
    loop._check_diverged(6)  # pylint: disable=protected-access
  expected = 5 if can_wait else 3
  assert error.value.checkpoint_step == expected
  assert (f"the newest checkpoint on disk is /ckpt/{expected}, whose parameters are "
          f"those after step {min(expected, 4)}") in str(error.value)
  loop.consecutive_skipped = 1  # under the limit: no error
  loop._check_diverged(6)  # pylint: disable=protected-access
