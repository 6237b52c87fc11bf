"""openmoe-ablate's command line: what it hands the arm runner and the study (both
stubbed: the training itself is test_ablate.py's and test_double_win.py's), its
defaults and the bounds of its numbers."""
import dataclasses
import json

import pytest

from openmoe_jax import ablate
from openmoe_jax.cli import ablate as ablate_cli
from openmoe_jax.cli import flags
from openmoe_jax.studies import double_win


@pytest.fixture
def arms_runs(monkeypatch):
  """Stubs the arm runner; returns the list of its calls' arguments."""
  calls = []

  def run_arms(arms, steps, output, run_gin, bindings, log, emit):
    calls.append(dict(arms=list(arms), steps=steps, output=output, run_gin=run_gin,
                      bindings=list(bindings)))
    log("progress line")
    emit(ablate.ArmResult(arm=arms[0], steps=steps, first_val_loss=2.0, val_loss=1.0,
                          train_loss=1.0, drop_fraction=0.0, expert_load_cv=0.0,
                          tokens_per_sec=1.0, seconds=1.0))
    return {}
  monkeypatch.setattr(ablate_cli, "run_arms", run_arms)
  monkeypatch.setattr(ablate_cli, "format_table", lambda results: "the table")
  return calls


def test_arms_default_to_all_of_them_for_100_steps_of_the_tiny_run(arms_runs, capsys):
  assert ablate_cli.main([]) == 0
  assert arms_runs.pop() == dict(arms=ablate.available_arms(), steps=100,
                                 output="/tmp/openmoe_ablate",
                                 run_gin="runs/ablate_tiny.gin", bindings=[])
  assert capsys.readouterr().out == "progress line\n\nthe table\n"


def test_arms_take_the_flags_and_json_keeps_stdout_for_the_rows(arms_runs, capsys):
  assert ablate_cli.main(["--arms=dense,ec_batch", "--steps=50", "--output=/tmp/o",
                          "--run_gin=runs/double_win.gin", "--gin.BATCH_SIZE=4",
                          "--json"]) == 0
  assert arms_runs.pop() == dict(arms=["dense", "ec_batch"], steps=50, output="/tmp/o",
                                 run_gin="runs/double_win.gin",
                                 bindings=["BATCH_SIZE = 4",  # and double_win.gin's
                                           "adamw_warmup_cosine.warmup_steps = 5"])
  out, err = capsys.readouterr()
  assert json.loads(out)["arm"] == "dense" and json.loads(out)["steps"] == 50
  assert err.splitlines()[-1] == "progress line"  # after the warmup note


def test_a_warmup_longer_than_the_run_is_shortened_and_said(arms_runs, capsys):
  assert ablate_cli.main(["--arms=dense", "--steps=10"]) == 0
  call = arms_runs.pop()
  assert call["bindings"] == ["adamw_warmup_cosine.warmup_steps = 1"]
  assert capsys.readouterr().out.startswith("--steps=10 is not longer than the warmup")


@pytest.mark.parametrize("flag", ["--unique_tokens=5", "--validation_tokens=5",
                                  "--eval_points=5", "--dlm_samples=5",
                                  "--dense_model=a.gin", "--moe_model=b.gin"])
def test_study_flags_need_the_study(arms_runs, flag, capsys):
  assert ablate_cli.main([flag]) == 2
  assert f"{flag.split('=')[0]} needs --study" in capsys.readouterr().err
  assert not arms_runs


@pytest.fixture
def study_runs(monkeypatch):
  """Stubs the study and its report; returns the list of (settings, output)."""
  calls = []
  monkeypatch.setattr(double_win, "run_study",
                      lambda settings, output: calls.append((settings, output)) or {})
  report = ablate_cli.double_win_report
  monkeypatch.setattr(report, "write_report", lambda results, output: {
      "markdown": f"{output}/report.md", "plot": "p.png", "json": "r.json"})
  monkeypatch.setattr(report, "format_table", lambda results: "study table")
  monkeypatch.setattr(report, "answers", lambda results: ["answer"])
  return calls


def test_the_study_runs_its_own_defaults(study_runs, capsys):
  assert ablate_cli.main(["--study=double_win"]) == 0
  settings, output = study_runs.pop()
  assert settings == double_win.StudySettings()
  assert output == "/tmp/openmoe_double_win"
  assert capsys.readouterr().out.splitlines()[-1] == (
      "report: /tmp/openmoe_double_win/report.md; plot: p.png; JSON: r.json")


def test_the_study_takes_each_flag(study_runs):
  assert ablate_cli.main([
      "--study=double_win", "--steps=300", "--unique_tokens=7", "--validation_tokens=8",
      "--eval_points=3", "--dlm_samples=2", "--run_gin=runs/ablate_tiny.gin",
      "--dense_model=d.gin", "--moe_model=m.gin", "--output=/tmp/s",
      "--gin.BATCH_SIZE=4"]) == 0
  settings, output = study_runs.pop()
  assert output == "/tmp/s"
  assert dataclasses.asdict(settings) == dataclasses.asdict(double_win.StudySettings(
      steps=300, unique_tokens=7, validation_tokens=8, eval_points=3, dlm_samples=2,
      run_gin="runs/ablate_tiny.gin", dense_gin="d.gin", moe_gin="m.gin",
      bindings=("BATCH_SIZE = 4",)))


def test_number_flags_take_their_smallest_value_and_refuse_below():
  parse = lambda *argv: ablate_cli.PROGRAM.parse(list(argv))[0]
  args = parse("--steps=1", "--unique_tokens=1", "--validation_tokens=1",
               "--eval_points=1", "--dlm_samples=2")
  assert (args.steps, args.unique_tokens, args.validation_tokens, args.eval_points,
          args.dlm_samples) == (1, 1, 1, 1, 2)
  for bad in ("--steps=0", "--unique_tokens=0", "--validation_tokens=0",
              "--eval_points=0", "--dlm_samples=1"):
    with pytest.raises(flags.UsageError, match=bad.split("=")[0]):
      parse(bad)


def test_the_study_refuses_arms_and_json_and_says_when_it_shortens_the_warmup(
    study_runs, capsys):
  for extra in ("--arms=dense", "--json"):
    assert ablate_cli.main(["--study=double_win", extra]) == 2
    assert "--study takes no --arms or --json" in capsys.readouterr().err
  assert not study_runs
  assert ablate_cli.main(["--study=double_win", "--steps=20"]) == 0
  assert study_runs.pop()[0].bindings == ("adamw_warmup_cosine.warmup_steps = 2",)
  assert capsys.readouterr().out.startswith("--steps=20 is not longer than the warmup")
