"""The one flag helper of every openmoe-* program (t5x flag conventions).

Each program describes itself once (`Program`: purpose, flags, examples) and runs
its body through `Program.main`, which gives every program the same behaviour:

- `--help` prints the purpose, the flags (gin flags included where the program
  takes them) and examples, and exits 0;
- bad input (an unknown flag, a gin file or binding gin rejects, a missing
  required value, a missing file) prints ONE line `<prog>: error: ...` on stderr
  and returns EXIT_USAGE (2), no traceback; `--verbose` shows the traceback (and
  the raw native logs, see cli/environment.py);
- Ctrl-C outside training prints one line and returns EXIT_INTERRUPTED (130).

Gin flags (`--gin_file=`, `--gin.NAME=VALUE`, `--gin_bindings=`,
`--gin_search_paths=`) are split off first by `gin_utils.parse_flags`; argparse
sees the rest.
"""
import argparse
import dataclasses
import math
import sys
import textwrap
import traceback
from typing import Callable, List, Optional, Sequence, Tuple

from openmoe_jax import errors, gin_utils

EXIT_OK = 0
EXIT_RUN_FAILED = 1  # the run stopped: storage failure, divergence (one line)
EXIT_USAGE = 2  # bad command line or configuration (argparse's code)
EXIT_INTERRUPTED = 130  # Ctrl-C (the shell's code for an interrupted command)

GIN_FLAGS_HELP = """gin flags (t5x conventions):
  --gin_file=FILE         a gin file, repeatable; looked up in the current folder,
                          then --gin_search_paths, then the installed gin/ folder
                          (so --gin_file=runs/quickstart.gin works anywhere)
  --gin.NAME=VALUE        override a binding or macro, repeatable, e.g.
                          --gin.TRAIN_STEPS=100 --gin.MODEL_DIR=/tmp/run
  --gin_search_paths=A,B  extra folders to look for gin files in (must exist)"""


class UsageError(Exception):
  """Bad command-line input; reported as one `<prog>: error:` line, exit 2."""


# Errors that mean "the input is wrong", not "the program is wrong".
USER_ERRORS = (UsageError, gin_utils.GinConfigError, FileNotFoundError,
               FileExistsError, NotADirectoryError, ValueError)


_SELF_EXPLAINING = (gin_utils.GinConfigError, FileNotFoundError, FileExistsError,
                    NotADirectoryError, errors.InputError)


class _Parser(argparse.ArgumentParser):
  """argparse that raises UsageError instead of printing usage and exiting, and
  lists the gin flags in the usage line of programs that take them."""

  gin_usage = ""

  def error(self, message):
    raise UsageError(message)

  def format_usage(self):
    return self._with_gin(super().format_usage())

  def format_help(self):
    return self._with_gin(super().format_help())

  def _with_gin(self, text: str) -> str:
    if not self.gin_usage:
      return text
    usage, _, rest = text.partition("\n\n")
    return usage.rstrip("\n") + " " + self.gin_usage + "\n" + (
        "\n" + rest if rest else "")


def int_at_least(low: int) -> Callable[[str], int]:
  """Returns an argparse `type` accepting integers >= `low`; a bad value reads
  `argument --flag: expected an integer >= low, got 'x'`."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      value = None
    if value is None or value < low:
      raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return value
  return parse


def float_in(low: float, high: float = math.inf, low_open: bool = False
             ) -> Callable[[str], float]:
  """Returns an argparse `type` accepting numbers in [low, high] ((low, high] with
  `low_open`); a bad value reads `argument --flag: expected ..., got 'x'`."""
  bounds = (f"> {low}" if low_open else f">= {low}") + (
      f" and <= {high}" if high != math.inf else "")
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      value = math.nan
    if not (value > low if low_open else value >= low) or not value <= high:
      raise argparse.ArgumentTypeError(f"expected a number {bounds}, got {text!r}")
    return value
  return parse


@dataclasses.dataclass(frozen=True)
class GinFlags:
  """The gin flags of a command line."""

  files: List[str]
  bindings: List[str]
  search_paths: List[str]


class Program:
  """One command-line program: its help text, its flags and how it reports errors."""

  def __init__(self, prog: str, purpose: str, examples: Sequence[str],
               gin: bool = False, details: str = "",
               parents: Sequence[argparse.ArgumentParser] = ()):
    self.prog, self.gin = prog, gin
    epilog = "example" + ("s" if len(examples) > 1 else "") + ":\n" + "\n".join(
        "  " + e for e in examples)
    if gin:
      epilog = GIN_FLAGS_HELP + "\n\n" + epilog
    self.parser = _Parser(
        prog=prog, description=textwrap.fill(purpose, 80) + (
            "\n\n" + "\n".join(textwrap.fill(l, 80) for l in details.splitlines())
            if details else ""),
        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False, parents=list(parents))
    if gin:
      self.parser.gin_usage = "[--gin_file=FILE ...] [--gin.NAME=VALUE ...]"
    self.parser.add_argument(
        "--verbose", action="store_true",
        help="keep the raw logs of TensorFlow/XLA/libtpu and show tracebacks")

  def add(self, *args, **kwargs) -> argparse.Action:
    """Adds a flag (argparse.add_argument arguments); returns its Action."""
    return self.parser.add_argument(*args, **kwargs)

  def parse(self, argv: Optional[Sequence[str]] = None
            ) -> Tuple[argparse.Namespace, GinFlags]:
    """Returns (flags, gin flags) of `argv` (default sys.argv[1:]); raises
    UsageError (or GinConfigError) on bad input, SystemExit(0) after --help."""
    argv = list(sys.argv[1:] if argv is None else argv)
    files, bindings, paths, other = gin_utils.parse_flags(argv)
    if not self.gin and (files or bindings or paths):
      raise UsageError("this program takes no gin flags (--gin_file, --gin.NAME=...)")
    args = self.parser.parse_args(other)
    return args, GinFlags(files, bindings, paths)

  def error(self, message: str) -> None:
    """Prints `<prog>: error: <first line of message>` on stderr. Returns None."""
    line = str(message).strip().splitlines()[0] if str(message).strip() else "failed"
    print(f"{self.prog}: error: {line}", file=sys.stderr, flush=True)

  def main(self, body: Callable[[argparse.Namespace, GinFlags], Optional[int]],
           argv: Optional[Sequence[str]] = None) -> int:
    """Parses `argv`, runs body(flags, gin_flags); returns body's exit code (None
    means 0), EXIT_USAGE after one error line on bad input, EXIT_INTERRUPTED on
    Ctrl-C. --help raises SystemExit(0)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in argv
    try:
      args, gin_flags = self.parse(argv)
      return body(args, gin_flags) or EXIT_OK
    except USER_ERRORS as e:
      if verbose:
        traceback.print_exc()
      if isinstance(e, UsageError):
        hint = f" (see {self.prog} --help)"
      elif verbose or isinstance(e, _SELF_EXPLAINING):
        hint = ""
      else:  # a ValueError from deep inside may be a bug: offer the traceback
        hint = " (run with --verbose for the traceback)"
      lines = str(e).strip().splitlines() or [type(e).__name__]
      self.error(lines[0] + hint)
      return EXIT_USAGE
    except errors.RunError as e:
      if verbose:
        traceback.print_exc()
      lines = str(e).strip().splitlines() or [type(e).__name__]
      print(f"{self.prog}: stopped: {lines[0]}", file=sys.stderr, flush=True)
      return EXIT_RUN_FAILED
    except KeyboardInterrupt:
      print(f"\n{self.prog}: interrupted", file=sys.stderr, flush=True)
      return EXIT_INTERRUPTED
