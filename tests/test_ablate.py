"""openmoe-ablate: every OpenMoE 2 arm trains, and the runner tabulates them."""
import dataclasses
import json
import math

import gin
import pytest

from openmoe_jax import ablate, gin_utils
from openmoe_jax.cli import ablate as ablate_cli

EXPECTED_ARMS = {
    "tc_softmax", "tc_sigmoid", "tc_dropless", "tc_scaling", "ec_batch", "ec_sequence",
    "ec_tokenwise_lb", "ec_scaling", "shared_always_on", "shared_gated",
    "granularity_64", "granularity_256", "dense_first2", "dense", "upcycled"}
# Small and quick: every arm still builds, routes, upcycles and trains.
TINY = ["--gin.train.num_devices=1", "--gin.BATCH_SIZE=4", "--gin.SEQUENCE_LENGTH=32", "--gin.train.eval_batches=1",
        "--gin.train.log_every_steps=1", "--gin.adamw_warmup_cosine.warmup_steps=1"]


def test_every_ablation_of_the_issue_has_an_arm(capsys):
  assert set(ablate.available_arms()) == EXPECTED_ARMS
  assert ablate_cli.main(["--list"]) == 0
  assert set(capsys.readouterr().out.split()) == EXPECTED_ARMS


def test_bad_arguments(capsys):
  with pytest.raises(ValueError, match="unknown arms"):
    ablate.run_arms(["nope"], 2, "/tmp/unused", "runs/ablate_tiny.gin")
  assert ablate_cli.main(["--gin_file=models/quickstart_moe.gin"]) == 2
  assert "--run_gin" in capsys.readouterr().err
  assert ablate_cli.main(["--stepz=3"]) == 2
  assert "--stepz" in capsys.readouterr().err


def test_short_runs_scale_the_warmup_down_and_say_so():
  # runs/ablate_tiny.gin warms up for 10 steps: --steps=10 used to fail in the
  # schedule ("total_steps (10) must exceed warmup_steps (10)").
  bindings, note = ablate.short_run_bindings("runs/ablate_tiny.gin", 10,
                                            ["train.log_every_steps = 5"])
  assert bindings == ["train.log_every_steps = 5",
                      "adamw_warmup_cosine.warmup_steps = 1"]
  assert "warming up for 1 step" in note
  assert ablate.short_run_bindings("runs/ablate_tiny.gin", 11) == ([], None)
  # The bindings build the optimizer the ablation then trains with.
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/ablate_tiny.gin"], ["TRAIN_STEPS = 10", *bindings],
                      finalize=False)
  from openmoe_jax.optim import adamw_warmup_cosine  # pylint: disable=g-import-not-at-top
  adamw_warmup_cosine()


def test_the_short_warmup_is_a_tenth_of_the_steps_and_one_step_is_refused():
  longer = ["adamw_warmup_cosine.warmup_steps = 200"]
  bindings, note = ablate.short_run_bindings("runs/ablate_tiny.gin", 100, longer)
  assert bindings == longer + ["adamw_warmup_cosine.warmup_steps = 10"]
  assert note == ("--steps=100 is not longer than the warmup of runs/ablate_tiny.gin "
                  "(200 steps): warming up for 10 step(s) instead "
                  "(adamw_warmup_cosine.warmup_steps=10)")
  with pytest.raises(ValueError, match="--steps=1 is too short: train at least 2"):
    ablate.short_run_bindings("runs/ablate_tiny.gin", 1)


def test_an_upcycled_arm_trains_after_its_dense_source(monkeypatch, tmp_path):
  """The upcycled arm starts from the dense arm's checkpoint: listed first, the dense
  arm is moved before it; not listed, it is trained first (and its row left out);
  already trained under the same output, it is reused."""
  ran = []

  def run_arm(arm, *args):
    ran.append(arm)
    return arm

  monkeypatch.setattr(ablate, "run_arm", run_arm)
  out = str(tmp_path)
  assert ablate.run_arms(["upcycled", "tc_softmax", "dense"], 2, out, "run.gin",
                         print_fn=lambda *_: None) == ["upcycled", "tc_softmax", "dense"]
  assert ran == ["dense", "upcycled", "tc_softmax"]
  ran.clear()
  reported = []
  assert ablate.run_arms(["upcycled"], 2, out, "run.gin", print_fn=lambda *_: None,
                         on_result=reported.append) == ["upcycled"]
  assert ran == ["dense", "upcycled"] and reported == ["upcycled"]
  ran.clear()
  (tmp_path / "dense" / "checkpoints").mkdir(parents=True)
  ablate.run_arms(["upcycled"], 2, out, "run.gin", print_fn=lambda *_: None)
  assert ran == ["upcycled"]


def test_arms_without_a_source_train_alone_and_number_their_progress(monkeypatch,
                                                                      tmp_path):
  """An arm that is not upcycled trains alone; each arm's banner counts the arms to
  train, and its own lines carry its name."""
  def run_arm(arm, steps, output, run_gin, bindings, print_fn):
    print_fn(f"training {steps} steps")
    return arm

  monkeypatch.setattr(ablate, "run_arm", run_arm)
  lines = []
  assert ablate.run_arms(["tc_softmax"], 3, str(tmp_path), "run.gin",
                         print_fn=lines.append) == ["tc_softmax"]
  assert lines == ["=== arm 1/1: tc_softmax (3 steps) ===",
                   "[tc_softmax] training 3 steps"]
  lines.clear()
  ablate.run_arms(["upcycled"], 3, str(tmp_path), "run.gin", print_fn=lines.append)
  assert lines == ["=== arm 1/2: dense (3 steps) ===", "[dense] training 3 steps",
                   "=== arm 2/2: upcycled (3 steps) ===", "[upcycled] training 3 steps"]


def test_a_too_long_warmup_names_the_binding_and_the_minimum():
  from openmoe_jax.optim import adamw_warmup_cosine  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"at least 11 steps.*adamw_warmup_cosine\.warmup"):
    adamw_warmup_cosine(warmup_steps=10, total_steps=10)


def test_table_formatting():
  rows = [ablate.ArmResult("tc_softmax", 5, 9.0, 7.25, 7.5, 0.125, 0.5, 1234.0, 3.0),
          ablate.ArmResult("dense", 5, 9.0, 7.0, 7.1, None, None, 2000.0, 2.0)]
  table = ablate.format_table(rows).splitlines()
  assert table[0].split()[:3] == ["arm", "steps", "val"]
  assert table[2].split() == ["tc_softmax", "5", "7.2500", "9.0000", "0.125", "0.500",
                              "1234"]
  assert table[3].split() == ["dense", "5", "7.0000", "9.0000", "-", "-", "2000"]


def _check_row(r):
  assert r["steps"] == 2
  assert math.isfinite(r["val_loss"]) and math.isfinite(r["first_val_loss"])
  assert r["tokens_per_sec"] > 0
  if r["arm"] == "dense":
    assert r["drop_fraction"] is None and r["expert_load_cv"] is None
  else:
    assert 0 <= r["drop_fraction"] <= 1 and r["expert_load_cv"] >= 0
  if r["arm"] == "tc_dropless":
    assert r["drop_fraction"] == 0


# One test per arm (pytest-xdist spreads them over the workers); `upcycled` trains
# its source arm `dense` first, `tc_softmax` goes through the CLI's --json output.
@pytest.mark.slow
@pytest.mark.parametrize("arm", sorted(EXPECTED_ARMS - {"dense"}))
def test_two_steps_of_each_arm(arm, tmp_path, capsys):
  if arm == "tc_softmax":
    assert ablate_cli.main([f"--output={tmp_path}", "--steps=2", "--json",
                        f"--arms={arm}"] + TINY) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["arm"] for r in rows] == [arm]
    _check_row(rows[0])
    # Arms never silently resume an old run.
    with pytest.raises(FileExistsError, match="already holds a run"):
      ablate.run_arms([arm], 2, str(tmp_path), "runs/ablate_tiny.gin")
    return
  arms = ["dense", arm] if arm == "upcycled" else [arm]
  _, bindings, _, _ = gin_utils.parse_flags(TINY)
  rows = [dataclasses.asdict(r) for r in ablate.run_arms(
      arms, 2, str(tmp_path), "runs/ablate_tiny.gin", bindings, print_fn=lambda _: None)]
  assert [r["arm"] for r in rows] == arms
  for r in rows:
    _check_row(r)
  if arm == "upcycled":
    # It starts from the trained dense arm: near its final loss (not equal: routing
    # picks slices at gates near, not exactly, 1/4 each).
    summary = json.loads((tmp_path / "upcycled" / "upcycle.json").read_text())
    assert {k: summary[k] for k in ("dense_step", "num_experts", "expert_d_ff",
                                    "slices_per_ffn", "moe_layers")} == {
        "dense_step": 2, "num_experts": 16, "expert_d_ff": 128, "slices_per_ffn": 4,
        "moe_layers": 4}  # experiments/openmoe2/upcycled.gin: d_ff 512 = 4 x 128
    # The upcycled step-0 checkpoint has drawn no batch: step 2 drew two.
    position = (tmp_path / "upcycled" / "checkpoints" / "2" / "data_position" /
                "metadata")
    assert json.loads(position.read_text())["train_batches"] == 2
    assert rows[1]["first_val_loss"] == pytest.approx(rows[0]["val_loss"], abs=0.3)


def test_an_arms_row_takes_each_number_from_its_own_summary_entry(tmp_path,
                                                                  monkeypatch):
  """run_arm's row: the train loss is the cross-entropy (comparable across arms
  whose router losses differ), not the total loss; every other field its own entry.
  Training itself is stubbed (all numbers distinct)."""
  summary = {"final_step": 2, "first_eval_loss": 5.0, "last_eval_loss": 4.0,
             "last_train_loss": 4.5, "last_train_ce_loss": 4.25,
             "last_train_metrics": {"moe/drop_fraction": 0.125,
                                    "moe/expert_load_cv": 0.375},
             "tokens_per_sec": 100.0}
  clock = iter([100.0, 112.5])  # training started at 100 s and ended at 112.5 s
  monkeypatch.setattr(ablate, "train", lambda print_fn: summary)
  monkeypatch.setattr(ablate.gin_utils, "check_required", lambda *a, **k: None)
  monkeypatch.setattr(ablate.time, "perf_counter", lambda: next(clock, 112.5))
  row = ablate.run_arm("tc_softmax", 2, str(tmp_path), "runs/ablate_tiny.gin")
  assert row.seconds == 12.5
  assert (row.steps, row.first_val_loss, row.val_loss, row.train_loss) == (
      2, 5.0, 4.0, 4.25)
  assert (row.drop_fraction, row.expert_load_cv, row.tokens_per_sec) == (
      0.125, 0.375, 100.0)
