"""Every console program: real --help, one-line errors with exit 2 (cli/flags.py)."""
import importlib

import pytest

from openmoe_jax.cli import flags

# console_scripts of setup.py: program -> module whose main() it runs.
PROGRAMS = {
    "openmoe-train": "openmoe_jax.train",
    "openmoe-analyze": "openmoe_jax.analysis.cli",
    "openmoe-params": "openmoe_jax.param_count",
    "openmoe-plan": "openmoe_jax.plan",
    "openmoe-sample": "openmoe_jax.sample",
    "openmoe-eval": "openmoe_jax.evaluate",
    "openmoe-upcycle": "openmoe_jax.upcycle",
    "openmoe-ablate": "openmoe_jax.ablate",
    "openmoe-convert": "openmoe_jax.cli.convert",
}


def test_the_list_is_every_console_script():
  import os, re  # pylint: disable=g-import-not-at-top,multiple-imports
  setup = open(os.path.join(os.path.dirname(__file__), "..", "setup.py")).read()
  declared = dict(re.findall(r'"(openmoe-[a-z]+)=([\w.]+):main"', setup))
  assert declared == PROGRAMS


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
  from openmoe_jax import train  # pylint: disable=g-import-not-at-top
  assert train.main(["--gin_file=runs/quickstart.gin",
                     "--gin.ModelConfig.d_modle=3"]) == flags.EXIT_USAGE
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "d_modle" in err[0]
  assert err[0].startswith("openmoe-train: error: ")


def test_a_missing_search_path_is_an_error(capsys, tmp_path):
  from openmoe_jax import train  # pylint: disable=g-import-not-at-top
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
