"""Training: one step, exact resume, CLI end to end, gin error messages."""
import glob
import json
import os
import signal
import subprocess
import sys

import gin
import pytest

from openmoe_jax import gin_utils
from openmoe_jax.cli import flags
from openmoe_jax.cli import train as train_cli
from openmoe_jax.trainer import train
from run_files import logged_losses

TINY_BINDINGS = [
    "ModelConfig.d_model = 32", "ModelConfig.num_heads = 2", "ModelConfig.head_dim = 16",
    "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 2", "MoeConfig.num_experts = 4",
    "MoeConfig.group_size = 64", "SEQUENCE_LENGTH = 64", "BATCH_SIZE = 8",
    "train.eval_batches = 2", "train.log_every_steps = 1",
]


def _configure(model_dir, steps, extra=()):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/quickstart.gin"],
                      TINY_BINDINGS + [f"MODEL_DIR = '{model_dir}'",
                                       f"TRAIN_STEPS = {steps}"] + list(extra))


@pytest.mark.slow
def test_resume_gives_exactly_the_uninterrupted_losses(tmp_path):
  common = ["train.checkpoint_every_steps = 2", "train.eval_every_steps = 100",
            "adamw_warmup_cosine.warmup_steps = 1", "adamw_warmup_cosine.total_steps = 4"]
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  _configure(straight, 4, common)
  summary = train(print_fn=lambda *_: None)
  assert summary["final_step"] == 4
  _configure(resumed, 2, common)
  train(print_fn=lambda *_: None)
  _configure(resumed, 4, common)
  lines = []
  summary = train(print_fn=lines.append)
  assert summary["start_step"] == 2 and any("Resumed from step 2" in l for l in lines)
  expected, got = logged_losses(straight), logged_losses(resumed)
  assert set(got) == {1, 2, 3, 4}
  for step in (3, 4):  # the steps after restore: same params, same data batches
    assert got[step] == expected[step]
  assert expected[4] != expected[3]


@pytest.mark.slow
def test_cli_end_to_end_writes_checkpoints_metrics_and_events(tmp_path):
  model_dir = tmp_path / "run"
  args = ["--gin_file=runs/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
          "--gin.TRAIN_STEPS=4", "--gin.train.eval_every_steps=2",
          "--gin.train.checkpoint_every_steps=2",
          "--gin.adamw_warmup_cosine.warmup_steps=1"]
  args += [f"--gin.{b.replace(' ', '')}" for b in TINY_BINDINGS]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "openmoe_jax.cli.train"] + args,
                        capture_output=True, text=True, env=env, timeout=600,
                        cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "first_eval_ce_loss" in proc.stdout and "tokens_per_sec" in proc.stdout
  # Native-library noise is filtered (cli/environment.py); TensorFlow prints its
  # oneDNN notice whatever TF_CPP_MIN_LOG_LEVEL says.
  for noise in ("oneDNN", "cuInit", "precompiled_charsmap", "absl::InitializeLog"):
    assert noise not in proc.stderr, proc.stderr
  assert "eta" in proc.stdout
  steps = sorted(os.listdir(model_dir / "checkpoints"))
  assert steps == ["2", "4"]
  rows = [json.loads(l) for l in open(model_dir / "metrics.jsonl")]
  assert any("eval/ce_loss" in r for r in rows)
  assert any("train/tokens_per_sec" in r and "moe/drop_fraction" in r for r in rows)
  # Model layer numbers, as in the analysis report: 2 layers, the MoE one is layer 1.
  assert any("moe/layer_1/expert_load_cv" in r for r in rows)
  assert not any("moe/layer_0/expert_load_cv" in r for r in rows)
  assert any("eval/moe/drop_fraction" in r for r in rows)
  assert glob.glob(str(model_dir / "events.out.tfevents.*"))
  assert os.path.exists(model_dir / "config.gin")


def _error_line(capsys):
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("openmoe-train: error: "), err
  return err[0]


def test_unknown_binding_fails_naming_it(capsys):
  assert train_cli.main(["--gin_file=runs/quickstart.gin",
                         "--gin.ModelConfig.d_modle=3"]) == 2
  assert "d_modle" in _error_line(capsys)


def test_missing_required_value_fails_naming_it(capsys):
  assert train_cli.main(["--gin_file=runs/train_base.gin"]) == 2
  assert "MODEL_DIR" in _error_line(capsys)
  gin.clear_config()
  assert train_cli.main(["--gin_file=runs/train_base.gin", "--gin.MODEL_DIR=/tmp/x",
                         "--gin.MIXTURE_OR_TASK_NAME=local_mix", "--gin.TRAIN_STEPS=1",
                         "--gin.BATCH_SIZE=1", "--gin.SEQUENCE_LENGTH=8"]) == 2
  assert "train.optimizer" in _error_line(capsys)


def test_the_summary_says_n_a_where_no_step_ran(capsys):
  """A relaunched finished run ran no step: no throughput, no MFU; keys the summary
  lacks are left out."""
  train_cli.print_run_summary({"last_eval_ce_loss": 2.5, "tokens_per_sec": None,
                               "mfu": float("nan"), "final_step": 3})
  assert capsys.readouterr().out.splitlines() == [
      "", "=== openmoe_jax run summary ===",
      "    last_eval_ce_loss: 2.5000",
      "       tokens_per_sec: n/a (no training step ran)",
      "                  mfu: n/a",
      "           final_step: 3"]


def test_unknown_argument_is_rejected(capsys):
  assert train_cli.main(["--gin_file=runs/quickstart.gin", "--steps=3"]) == 2
  assert "--steps" in _error_line(capsys)


def _cli_args(model_dir, steps):
  args = ["--gin_file=runs/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
          f"--gin.TRAIN_STEPS={steps}", "--gin.train.eval_every_steps=1000",
          "--gin.train.checkpoint_every_steps=1000",
          "--gin.adamw_warmup_cosine.warmup_steps=1"]
  return [sys.executable, "-m", "openmoe_jax.cli.train"] + args + [
      f"--gin.{b.replace(' ', '')}" for b in TINY_BINDINGS]


def _rows_by_kind(model_dir):
  """Returns ({step: count} of train rows, {step: count} of eval rows)."""
  train_rows, eval_rows = {}, {}
  for line in open(model_dir / "metrics.jsonl"):
    row = json.loads(line)
    counts = train_rows if "train/loss" in row else eval_rows
    counts[row["step"]] = counts.get(row["step"], 0) + 1
  return train_rows, eval_rows


def _interrupt_and_resume(tmp_path, signum, expected_code, expected_line):
  """Stops a run with `signum` after its first progress line, checks the exit, the
  checkpoint, then resumes it (with a stale metrics row past the checkpoint) for two
  more steps and checks the metrics file holds one row per step."""
  model_dir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  proc = subprocess.Popen(_cli_args(model_dir, 1000), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
  output = []
  for line in proc.stdout:
    output.append(line)
    if line.startswith("step") and "/1000" in line:
      proc.send_signal(signum)
      break
  output += proc.stdout.readlines()
  stderr = proc.stderr.read()
  assert proc.wait(timeout=300) == expected_code, "".join(output)[-3000:] + stderr
  text = "".join(output)
  assert expected_line in text and "Run the same command again" in text, text
  assert "Traceback" not in stderr + text
  saved = int(sorted(os.listdir(model_dir / "checkpoints"), key=int)[-1])
  assert 1 <= saved < 1000
  assert f"stopped after step {saved};" in text
  train_rows, _ = _rows_by_kind(model_dir)
  assert max(train_rows) == saved  # the partial log window is written too
  with open(model_dir / "metrics.jsonl", "a") as f:  # as if a step ran after it
    f.write(json.dumps({"step": saved + 1, "train/loss": 1.0}) + "\n")
  relaunch = subprocess.run(_cli_args(model_dir, saved + 2), capture_output=True,
                            text=True, env=env, cwd=str(tmp_path), timeout=300)
  assert relaunch.returncode == 0, relaunch.stderr[-3000:]
  assert f"Resumed from step {saved}" in relaunch.stdout
  assert "final_step: " + str(saved + 2) in relaunch.stdout
  train_rows, eval_rows = _rows_by_kind(model_dir)
  assert train_rows == {step: 1 for step in range(1, saved + 3)}, train_rows
  assert eval_rows == {0: 1, saved + 2: 1}, eval_rows


@pytest.mark.slow
def test_sigterm_checkpoints_exits_cleanly_and_relaunch_resumes(tmp_path):
  _interrupt_and_resume(tmp_path, signal.SIGTERM, 0, "SIGTERM: stopped after step")


@pytest.mark.slow
def test_ctrl_c_checkpoints_exits_130_and_relaunch_resumes(tmp_path):
  _interrupt_and_resume(tmp_path, signal.SIGINT, 130, "Ctrl-C: stopped after step")


@pytest.mark.slow
def test_staged_training_switches_mixture_and_objective_and_resumes(tmp_path):
  stages = ["train.stages = [@code/Stage(), @text/Stage()]",
            "code/Stage.start_step = 0", "code/Stage.mixture_or_task_name = 'local_code'",
            "text/Stage.start_step = 2", "text/Stage.mixture_or_task_name = 'local_text'",
            "text/Stage.objective = @text/CausalLm()", "text/CausalLm.z_loss = 0.0",
            "train.checkpoint_every_steps = 2", "train.eval_every_steps = 100",
            "adamw_warmup_cosine.warmup_steps = 1", "adamw_warmup_cosine.total_steps = 4"]
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  _configure(straight, 4, stages)
  lines = []
  train(print_fn=lines.append)
  assert any("Stage 1: local_text with CausalLm from step 2" in l for l in lines)
  # Stage 0 trains the run's objective (logits z-loss 1e-4), stage 1 its own (0).
  with open(os.path.join(straight, "metrics.jsonl")) as f:
    rows = {r["step"]: r for r in map(json.loads, f) if "train/loss" in r}
  for step, z_loss in ((1, 1e-4), (2, 1e-4), (3, 0.0), (4, 0.0)):
    row = rows[step]
    assert row["train/loss"] - row["train/ce_loss"] - row["moe/aux_loss"] == (
        pytest.approx(z_loss * row["train/logits_z_loss"], abs=2e-5)), step
  assert 1e-4 * rows[1]["train/logits_z_loss"] > 2e-4  # the two stages differ
  _configure(resumed, 2, stages)
  train(print_fn=lambda *_: None)
  _configure(resumed, 4, stages)
  lines = []
  train(print_fn=lines.append)
  assert not any("Stage 0" in l for l in lines)  # resumed straight into stage 1
  expected, got = logged_losses(straight), logged_losses(resumed)
  for step in (3, 4):
    assert got[step] == expected[step]


def test_a_failing_run_still_closes_the_checkpointer_and_the_metrics_writers(
    tmp_path, monkeypatch):
  from openmoe_jax import checkpoints, metrics, train_loop  # pylint: disable=g-import-not-at-top
  closed = []
  for cls in (checkpoints.Checkpointer, metrics.MetricsLogger):
    original = cls.close
    def close(self, original=original, name=cls.__name__):
      closed.append(name)
      return original(self)
    monkeypatch.setattr(cls, "close", close)
  def crash(self, state, *args, **kwargs):
    del self, state, args, kwargs
    raise RuntimeError("device lost")
  monkeypatch.setattr(train_loop.TrainLoop, "run", crash)
  _configure(str(tmp_path / "run"), 2, ["adamw_warmup_cosine.warmup_steps = 1"])
  with pytest.raises(RuntimeError, match="device lost"):
    train(print_fn=lambda *_: None)
  assert sorted(closed) == ["Checkpointer", "MetricsLogger"]


@pytest.mark.parametrize("bindings,message", [
    ([], None),  # 8 x 64 = 512 tokens, group_size 64
    (["MoeConfig.group_size = 512"], None),  # one group: the whole batch
    (["MoeConfig.group_size = 4096"], None),  # larger than the batch: one group
    (["MoeConfig.group_size = 100"],
     "MoeConfig.group_size=100 must divide the 512 tokens of a training batch "
     "(BATCH_SIZE 8 / train.microbatches 1 x SEQUENCE_LENGTH 64); pick a divisor such "
     "as 512"),
    (["train.microbatches = 2", "MoeConfig.group_size = 512"], None),  # 256 a microbatch
    (["train.microbatches = 2", "MoeConfig.group_size = 100"],
     "the 256 tokens of a training batch (BATCH_SIZE 8 / train.microbatches 2 x "
     "SEQUENCE_LENGTH 64); pick a divisor such as 256"),
    (["train.microbatches = 3", "MoeConfig.group_size = 100"], None),  # train() says
    (["SEQUENCE_LENGTH = 48", "BATCH_SIZE = 2", "MoeConfig.group_size = 64"],
     "the 96 tokens of a training batch (BATCH_SIZE 2 / train.microbatches 1 x "
     "SEQUENCE_LENGTH 48); pick a divisor such as 48"),  # the sequence itself
    (["ModelConfig.sparse_interval = 0", "MoeConfig.group_size = 100"], None),  # dense
])
def test_moe_groups_must_divide_a_training_batch_before_anything_is_written(
    bindings, message):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/quickstart.gin"],
                      ["SEQUENCE_LENGTH = 64", "BATCH_SIZE = 8",
                       "MoeConfig.group_size = 64", *bindings], finalize=False)
  if message is None:
    train_cli._check_moe_groups()  # pylint: disable=protected-access
  else:
    with pytest.raises(flags.UsageError) as e:
      train_cli._check_moe_groups()  # pylint: disable=protected-access
    assert message in str(e.value)
  gin.clear_config()


def _stub_train(monkeypatch, summary):
  """Replaces the training loop behind openmoe-train by one returning `summary`;
  returns the list its calls are appended to."""
  calls, real, check = [], train_cli.train, gin_utils.check_required

  def fake():
    calls.append(True)
    return summary
  monkeypatch.setattr(train_cli, "train", fake)
  # The required bindings are still checked, on the real (gin-registered) loop.
  monkeypatch.setattr(gin_utils, "check_required", lambda *configurables: check(
      *(real if c is fake else c for c in configurables)))
  return calls


def test_the_runs_task_is_checked_before_training_unless_stages_name_theirs(
    monkeypatch, tmp_path, capsys):
  calls = _stub_train(monkeypatch, {"final_step": 3})
  base = ["--gin_file=runs/quickstart.gin", f"--gin.MODEL_DIR={tmp_path}"]
  assert train_cli.main(base + ["--gin.MIXTURE_OR_TASK_NAME='local_mixx'"]) == 2
  assert "did you mean 'local_mix'" in _error_line(capsys) and not calls
  gin.clear_config()
  stages = ["--gin.train.stages=[@code/Stage()]", "--gin.code/Stage.start_step=0",
            "--gin.code/Stage.mixture_or_task_name='local_code'"]
  assert train_cli.main(base + ["--gin.MIXTURE_OR_TASK_NAME=None", *stages]) == 0
  assert calls == [True]
  assert "final_step: 3" in capsys.readouterr().out


def test_an_interrupted_run_exits_130_after_its_summary(monkeypatch, tmp_path, capsys):
  _stub_train(monkeypatch, {"final_step": 2, "interrupted": True})
  assert train_cli.main(["--gin_file=runs/quickstart.gin",
                         f"--gin.MODEL_DIR={tmp_path}"]) == flags.EXIT_INTERRUPTED == 130
  assert capsys.readouterr().out.splitlines()[-1] == "           final_step: 2"
  gin.clear_config()
  _stub_train(monkeypatch, {"final_step": 2, "interrupted": False})
  assert train_cli.main(["--gin_file=runs/quickstart.gin",
                         f"--gin.MODEL_DIR={tmp_path}"]) == 0
