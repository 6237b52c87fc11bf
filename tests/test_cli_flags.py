"""Every console program: real --help, one-line errors with exit 2 (cli/flags.py)."""
import argparse
import ast
import importlib
import os
import re

import pytest

from openmoe_jax import checkpoints, errors, train_loop
from openmoe_jax.cli import flags
from openmoe_jax.convert.layout import ConversionError
from openmoe_jax.data import sources

# console_scripts of setup.py: program -> module whose main() it runs.
PROGRAMS = {
    "openmoe-train": "openmoe_jax.cli.train",
    "openmoe-analyze": "openmoe_jax.cli.analyze",
    "openmoe-params": "openmoe_jax.cli.params",
    "openmoe-plan": "openmoe_jax.cli.plan",
    "openmoe-sample": "openmoe_jax.cli.sample",
    "openmoe-eval": "openmoe_jax.cli.evaluate",
    "openmoe-upcycle": "openmoe_jax.cli.upcycle",
    "openmoe-ablate": "openmoe_jax.cli.ablate",
    "openmoe-convert": "openmoe_jax.cli.convert",
}
PACKAGE = os.path.join(os.path.dirname(__file__), "..", "openmoe_jax")


def test_the_list_is_every_console_script():
  setup = open(os.path.join(os.path.dirname(__file__), "..", "setup.py")).read()
  declared = dict(re.findall(r'"(openmoe-[a-z]+)=([\w.]+):main"', setup))
  assert declared == PROGRAMS


@pytest.mark.parametrize("prog", sorted(PROGRAMS))
def test_each_program_is_a_cli_module_with_main_and_python_m(prog):
  module = importlib.import_module(PROGRAMS[prog])
  assert module.__name__.startswith("openmoe_jax.cli."), module.__name__
  assert callable(module.main) and module.flags is flags  # the one flag helper
  with open(module.__file__) as f:  # `python -m openmoe_jax.cli.<name>` runs main()
    assert 'if __name__ == "__main__":\n  sys.exit(main())' in f.read()


def _package_modules():
  """Yields (dotted name, parsed ast) of every module of the package."""
  for folder, _, files in os.walk(PACKAGE):
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
        with open(path) as f:
          yield "openmoe_jax." + rel, ast.parse(f.read())


def test_programs_live_in_cli_and_parse_flags_only_through_the_helper():
  outside, hand_parsed = [], []
  for name, tree in _package_modules():
    in_cli = name.startswith("openmoe_jax.cli.")
    for node in ast.walk(tree):
      if not in_cli and isinstance(node, ast.FunctionDef) and node.name == "main":
        outside.append(name)  # a program's entry point outside cli/
      if not in_cli and isinstance(node, ast.ImportFrom) and node.module == (
          "openmoe_jax.cli") and any(a.name == "flags" for a in node.names):
        outside.append(name)  # a library module declaring flags
      if name not in ("openmoe_jax.cli.flags", "openmoe_jax.cli.environment") and (
          isinstance(node, ast.Attribute) and node.attr in ("argv", "ArgumentParser")
          and isinstance(node.value, ast.Name) and node.value.id in ("sys", "argparse")):
        hand_parsed.append(name)  # sys.argv or a parser of its own
  assert not outside, f"programs outside openmoe_jax/cli/: {sorted(set(outside))}"
  assert not hand_parsed, f"argv parsed outside cli/flags.py: {sorted(set(hand_parsed))}"


@pytest.mark.parametrize("prog", sorted(PROGRAMS))
def test_help_exits_0_with_purpose_flags_and_an_example(prog, capsys):
  main = importlib.import_module(PROGRAMS[prog]).main
  with pytest.raises(SystemExit) as exit_info:
    main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(f"usage: {prog}")
  assert "example" in out and f"\n  {prog} " in out  # an example command line
  assert "--verbose" in out


@pytest.mark.parametrize("prog", sorted(PROGRAMS))
def test_unknown_flag_is_one_error_line_and_exit_2(prog, capsys):
  main = importlib.import_module(PROGRAMS[prog]).main
  assert main(["--no_such_flag=1"]) == flags.EXIT_USAGE
  captured = capsys.readouterr()
  err = captured.err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), captured.err
  assert "Traceback" not in captured.err + captured.out


def test_gin_errors_are_one_line(capsys):
  from openmoe_jax.cli import train  # pylint: disable=g-import-not-at-top
  assert train.main(["--gin_file=runs/quickstart.gin",
                     "--gin.ModelConfig.d_modle=3"]) == flags.EXIT_USAGE
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "d_modle" in err[0]
  assert err[0].startswith("openmoe-train: error: ")


def test_a_missing_search_path_is_an_error(capsys, tmp_path):
  from openmoe_jax.cli import train  # pylint: disable=g-import-not-at-top
  missing = str(tmp_path / "nope")
  # (An unknown gin file too, so that a broken check fails fast, not by training.)
  assert train.main(["--gin_file=no_such.gin",
                     f"--gin_search_paths={missing}"]) == flags.EXIT_USAGE
  assert "no such folder" in capsys.readouterr().err


def test_verbose_shows_the_traceback(capsys):
  program = flags.Program("openmoe-x", "Does x.", ["openmoe-x"])

  def body(args, gin_flags):
    raise ValueError("bad value")

  assert program.main(body, []) == flags.EXIT_USAGE
  assert "--verbose" in capsys.readouterr().err
  assert program.main(body, ["--verbose"]) == flags.EXIT_USAGE
  assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("error, code, prefix", [
    (errors.RunError("every checkpoint under /r is damaged\ndetails"), 1, "stopped: "),
    (errors.InputError("/d/x.jsonl:4: not a JSON line"), 2, "error: "),
    (ConversionError("/ckpt: no such directory"), 2, "error: "),
])
def test_run_and_input_errors_are_one_line_without_traceback(error, code, prefix,
                                                            capsys):
  program = flags.Program("openmoe-x", "Does x.", ["openmoe-x"])

  def body(args, gin_flags):
    raise error

  assert program.main(body, []) == code
  err = capsys.readouterr().err
  first = str(error).splitlines()[0]
  assert err.strip() == f"openmoe-x: {prefix}{first}"  # no hint, no traceback


def test_ctrl_c_is_exit_130_and_one_line_and_verbose_shows_a_run_error(capsys):
  program = flags.Program("openmoe-x", "Does x.", ["openmoe-x"])

  def interrupted(args, gin_flags):
    raise KeyboardInterrupt

  assert program.main(interrupted, []) == flags.EXIT_INTERRUPTED == 130
  assert capsys.readouterr().err.strip() == "openmoe-x: interrupted"

  def stopped(args, gin_flags):
    raise errors.RunError("the run diverged")

  assert program.main(stopped, ["--verbose"]) == flags.EXIT_RUN_FAILED
  err = capsys.readouterr().err
  assert "Traceback" in err and err.strip().endswith("openmoe-x: stopped: the run diverged")


def test_reliability_errors_are_run_or_input_errors():
  for run_error in (checkpoints.CheckpointSaveError, checkpoints.CheckpointDamagedError,
                    checkpoints.UnwritableDirectoryError, checkpoints.NonFiniteStateError,
                    train_loop.TrainingDivergedError):
    assert issubclass(run_error, errors.RunError), run_error
  for input_error in (checkpoints.CheckpointMismatchError, sources.DataFileError,
                      ConversionError):
    assert issubclass(input_error, errors.InputError), input_error


def test_number_flags_keep_their_bounds_open_or_closed():
  """float_in(low) takes low itself, float_in(low, low_open=True) refuses it; the
  high bound is inclusive; int_at_least(low) takes low, refuses low - 1."""
  assert flags.float_in(0.0)("0") == 0.0
  assert flags.float_in(0.0, low_open=True)("0.5") == 0.5
  with pytest.raises(argparse.ArgumentTypeError, match="> 0"):
    flags.float_in(0.0, low_open=True)("0")
  assert flags.float_in(0.0, 1.0)("1") == 1.0
  with pytest.raises(argparse.ArgumentTypeError):
    flags.float_in(0.0, 1.0)("1.5")
  with pytest.raises(argparse.ArgumentTypeError):
    flags.float_in(0.0)("-0.1")
  assert flags.int_at_least(1)("1") == 1
  with pytest.raises(argparse.ArgumentTypeError, match=">= 1"):
    flags.int_at_least(1)("0")


def test_bound_messages_name_both_bounds_only_when_there_is_a_high_one():
  with pytest.raises(argparse.ArgumentTypeError) as error:
    flags.float_in(0.0, 1.0)("1.5")
  assert str(error.value) == "expected a number >= 0.0 and <= 1.0, got '1.5'"
  with pytest.raises(argparse.ArgumentTypeError) as error:
    flags.float_in(0.0)("x")
  assert str(error.value) == "expected a number >= 0.0, got 'x'"


def test_gin_flags_are_listed_only_by_programs_that_take_them(capsys):
  """A program takes no gin flags unless it says so: its usage line and help leave
  them out, and a gin flag is a usage error. A gin program's usage line ends with
  them and its help explains them."""
  plain = flags.Program("openmoe-x", "Does x.", ["openmoe-x --n=1"])
  assert plain.parser.format_usage() == "usage: openmoe-x [-h] [--verbose]\n"
  assert "gin" not in plain.parser.format_help()
  assert "\nexample:\n  openmoe-x --n=1" in plain.parser.format_help()
  assert plain.main(lambda args, gin_flags: None, ["--gin_file=a.gin"]) == 2
  assert capsys.readouterr().err == (
      "openmoe-x: error: this program takes no gin flags (--gin_file, --gin.NAME=...)"
      " (see openmoe-x --help)\n")
  with_gin = flags.Program("openmoe-y", "Does y.", ["openmoe-y", "openmoe-y --v"],
                           gin=True)
  assert with_gin.parser.format_usage() == (
      "usage: openmoe-y [-h] [--verbose] [--gin_file=FILE ...] [--gin.NAME=VALUE ...]\n")
  help_text = with_gin.parser.format_help()
  assert help_text.startswith(
      "usage: openmoe-y [-h] [--verbose] [--gin_file=FILE ...] [--gin.NAME=VALUE ...]"
      "\n\nDoes y.\n")
  assert (flags.GIN_FLAGS_HELP + "\n\nexamples:\n  openmoe-y\n  openmoe-y --v"
          in help_text)
  _, gin_flags = with_gin.parse(["--gin_file=a.gin", "--gin.X=1"])
  assert (gin_flags.files, gin_flags.bindings) == (["a.gin"], ["X = 1"])


def test_a_body_returning_nothing_exits_0_and_its_own_code_otherwise():
  program = flags.Program("openmoe-x", "Does x.", ["openmoe-x"])
  assert program.main(lambda args, gin_flags: None, []) == 0
  assert program.main(lambda args, gin_flags: 3, []) == 3


def test_the_command_line_is_read_from_sys_argv_by_default(monkeypatch):
  program = flags.Program("openmoe-x", "Does x.", ["openmoe-x"])
  monkeypatch.setattr(flags.sys, "argv", ["openmoe-x", "--verbose"])
  assert program.parse()[0].verbose
  assert program.main(lambda args, gin_flags: 0 if args.verbose else 5) == 0


def test_flags_are_never_abbreviated_and_details_follow_the_purpose():
  program = flags.Program("openmoe-x", "Does x.", ["openmoe-x"],
                          details="First detail.\nSecond detail.")
  program.add("--num_batches", type=int)
  with pytest.raises(flags.UsageError, match="--num_b=3"):
    program.parse(["--num_b=3"])
  assert program.parse(["--num_batches=3"])[0].num_batches == 3
  assert "\n\nDoes x.\n\nFirst detail.\nSecond detail.\n" in program.parser.format_help()
