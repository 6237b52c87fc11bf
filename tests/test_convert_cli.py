"""openmoe-convert's command line: each command's required flags, its defaults and
the bounds of its numbers (the conversions themselves: test_convert.py)."""
import pytest

from openmoe_jax.cli import convert as convert_cli
from openmoe_jax.cli import flags

REQUIRED = {
    "from-t5x": ["--checkpoint=c", "--output=o"],
    "from-hf": ["--checkpoint=c", "--output=o"],
    "to-hf": ["--model_dir=m", "--output=o", "--layout=openmoe"],
    "params": ["--model_dir=m", "--output=o"],
}


def _parse(command, *extra):
  return convert_cli._program().parse([command, *REQUIRED[command], *extra])[0]  # pylint: disable=protected-access


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_each_required_flag_is_named_when_missing(command):
  assert _parse(command).command == command
  for i, flag in enumerate(REQUIRED[command]):
    rest = REQUIRED[command][:i] + REQUIRED[command][i + 1:]
    with pytest.raises(flags.UsageError, match=f"required: {flag.split('=')[0]}$"):
      convert_cli._program().parse([command, *rest])  # pylint: disable=protected-access
  with pytest.raises(flags.UsageError, match="required: COMMAND"):
    convert_cli._program().parse([])  # pylint: disable=protected-access


def test_defaults_as_the_help_says():
  for command in ("from-t5x", "from-hf"):
    args = _parse(command)
    assert (args.step, args.dtype) == (0, "float32")  # float32: no cast
  assert _parse("from-hf").layout is None  # read from config.json
  args = _parse("to-hf")
  assert (args.step, args.max_shard_gb) == (None, 2.0)  # the newest step, 2 GB shards
  args = _parse("params")
  assert (args.step, args.dtype) == (None, None)  # as trained
  assert _parse("params", "--verbose").verbose


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_steps_are_never_negative(command):
  assert _parse(command, "--step=0").step == 0
  with pytest.raises(flags.UsageError, match="--step"):
    _parse(command, "--step=-1")


def test_shards_must_have_a_positive_size():
  assert _parse("to-hf", "--max_shard_gb=0.001").max_shard_gb == 0.001
  for bad in ("0", "-1"):
    with pytest.raises(flags.UsageError, match="--max_shard_gb"):
      _parse("to-hf", f"--max_shard_gb={bad}")
