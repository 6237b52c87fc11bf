"""Gin flags and config parsing with t5x conventions.

Command line:  --gin_file=runs/quickstart.gin (repeatable)
               --gin.TRAIN_STEPS=100 --gin.MODEL_DIR=/tmp/run (repeatable)
               --gin_search_paths=dir1,dir2

(`TRAIN_STEPS` is the macro the run files bind `train.train_steps` and the learning
rate schedule's total steps to; `--gin.train.train_steps=100` alone would leave the
schedule at the file's length.)

Gin files are looked up in the current directory, then in --gin_search_paths, then in
the library's own gin folder (`gin_config_dir()`); `include` lines inside gin files
resolve the same way. Unknown configurables or parameters fail at parse time with the
offending binding named; `check_required` reports unbound gin.REQUIRED parameters
before anything is compiled.
"""
import contextlib
import difflib
import importlib
import importlib.util  # gin's resource reader calls importlib.util without importing it.
import inspect
import logging
import os
import re
import tokenize
from collections.abc import Iterable, Sequence

import gin
from etils import epath
from gin import config_parser

# What a program itself imports for its command-line bindings: the training entry
# point, whose imports register the model (config, MoE routers and dispatchers),
# objectives, optimizers, metrics, checkpoints and partitioning, and the data
# pipeline (seqio tasks, UL2, sources). The trainer imports the pipeline only inside
# `train`, so that `Trainer` loads without TensorFlow; a gin config is locked by
# then, and registering a configurable after that fails. openmoe-plan imports `plan`
# itself. Gin files name the modules they configure with `import` lines of their
# own (t5x style).
CONFIGURABLE_MODULES = ("openmoe_jax.trainer", "openmoe_jax.data.pipeline")

_QUOTED_OR_STRUCTURED = ("@", "%", "[", "(", "{", "'", '"')
# What gin raises for bad files/bindings: unknown names (ValueError), unreadable
# files (IOError), malformed values (SyntaxError, tokenize.TokenError), bad imports.
_PARSE_ERRORS = (ValueError, IOError, SyntaxError, tokenize.TokenError, ImportError)


class GinConfigError(ValueError):
  """A gin file, binding or required parameter problem, with the binding named."""


def import_configurables(modules: Iterable[str] = CONFIGURABLE_MODULES) -> None:
  """Imports `modules` so their gin configurables are registered. Returns None;
  ImportError propagates (a missing module is a bug, not an option)."""
  for name in modules:
    importlib.import_module(name)


def gin_config_dir() -> str | None:
  """Returns the library's gin folder, or None if it cannot be found.

  Installed wheel: `openmoe_jax/gin_configs` (setup.py maps the repo's `gin/` there).
  Source checkout or editable install: `<repo>/gin`, next to `openmoe_jax/`.
  """
  package_dir = os.path.dirname(os.path.abspath(__file__))
  installed = os.path.join(package_dir, "gin_configs")
  if os.path.isdir(installed):
    return installed
  repo = os.path.dirname(package_dir)
  # Only a checkout has setup.py beside the package; in site-packages a sibling
  # `gin/` is the gin-config library itself.
  if os.path.isfile(os.path.join(repo, "setup.py")) and os.path.isdir(os.path.join(repo, "gin")):
    return os.path.join(repo, "gin")
  return None


def _split_flag(arg: str, args: list[str], i: int, name: str) -> tuple[str | None, int]:
  """Returns (value, next index) if args[i] is --name=VALUE or --name VALUE."""
  if arg.startswith(f"--{name}="):
    return arg.split("=", 1)[1], i + 1
  if arg == f"--{name}":
    if i + 1 >= len(args):
      raise GinConfigError(f"--{name} needs a value")
    return args[i + 1], i + 2
  return None, i


def parse_flags(argv: Sequence[str]) -> tuple[list[str], list[str], list[str], list[str]]:
  """Splits command-line arguments into gin pieces.

  Returns (gin_files, gin_bindings, gin_search_paths, other): `--gin_file` values,
  bindings 'NAME=VALUE' from `--gin.NAME=VALUE` and `--gin_bindings=NAME=VALUE`,
  the comma-separated `--gin_search_paths`, and every other argument in order (so
  pass argv with or without the program name).
  """
  files, bindings, paths, other = [], [], [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    value, j = _split_flag(arg, args, i, "gin_file")
    if value is not None:
      files.append(value)
      i = j
      continue
    value, j = _split_flag(arg, args, i, "gin_search_paths")
    if value is not None:
      paths.extend(p for p in value.split(",") if p)
      i = j
      continue
    value, j = _split_flag(arg, args, i, "gin_bindings")
    if value is not None:
      bindings.append(value)
      i = j
      continue
    if arg.startswith("--gin."):
      name, sep, value = arg[len("--gin."):].partition("=")
      if not sep or not name:
        raise GinConfigError(f"expected --gin.NAME=VALUE, got {arg!r}")
      bindings.append(f"{name} = {quote_if_bare(value)}")
    else:
      other.append(arg)
    i += 1
  return files, bindings, paths, other


class _AnyReference(config_parser.ParserDelegate):
  """Accepts every @reference and %macro so values parse before registration."""

  def configurable_reference(self, scoped_configurable_name, evaluate):
    return scoped_configurable_name

  def macro(self, macro_name):
    return macro_name


def _is_gin_value(value: str) -> bool:
  try:
    parser = config_parser.ConfigParser(value, _AnyReference())
    parser.parse_value()
  except (SyntaxError, ValueError, tokenize.TokenError):
    return False
  return parser.current_token.type in (tokenize.NEWLINE, tokenize.ENDMARKER)


def quote_if_bare(value: str) -> str:
  """Returns `value` unchanged if it is a gin value (literal, @ref, %macro) or looks
  like an attempt at one; otherwise the python-quoted string, so `--gin.MODEL_DIR=/tmp/x`
  means MODEL_DIR = '/tmp/x'."""
  stripped = value.strip()
  if not stripped or stripped.startswith(_QUOTED_OR_STRUCTURED) or _is_gin_value(stripped):
    return value
  return repr(value)


def _drop_gin_path_misses(record: logging.LogRecord) -> bool:
  # gin's package-resource reader logs an ERROR for every search path that lacks an
  # included file, even when a later path has it.
  return record.msg != "Path not found: %s"


@contextlib.contextmanager
def _gin_search_paths(paths: Sequence[str]):
  # gin resolves `include` lines against one global prefix list and offers no way to
  # remove entries; set it to exactly `paths` while parsing, then put it back.
  prefixes = gin.config._LOCATION_PREFIXES  # pylint: disable=protected-access
  saved = list(prefixes)
  prefixes[:] = list(paths)
  root_logger = logging.getLogger()
  root_logger.addFilter(_drop_gin_path_misses)
  try:
    yield
  finally:
    prefixes[:] = saved
    root_logger.removeFilter(_drop_gin_path_misses)


def search_paths(extra: Sequence[str] = ()) -> list[str]:
  """Returns the directories gin files are looked up in, in order: the current
  directory, `extra`, then the library's gin folder. Raises GinConfigError naming
  an `extra` folder that does not exist (a typo would otherwise go unnoticed)."""
  missing = [p for p in extra if not os.path.isdir(p)]
  if missing:
    raise GinConfigError("--gin_search_paths: no such folder: "
                         + ", ".join(repr(p) for p in missing))
  paths = [os.getcwd()] + [os.path.abspath(p) for p in extra]
  installed = gin_config_dir()
  if installed:
    paths.append(installed)
  return list(dict.fromkeys(paths))


def resolve_gin_file(name: str, paths: Sequence[str]) -> str:
  """Returns the path of gin file `name` in the first of `paths` holding it.

  Raises GinConfigError listing the searched directories when none does.
  """
  candidates = [name] if os.path.isabs(name) else [os.path.join(p, name) for p in paths]
  for candidate in candidates:
    if os.path.isfile(candidate):
      return candidate
  raise GinConfigError(
      f"gin file {name!r} not found; searched: " + ", ".join(repr(p) for p in paths))


def parse_gin(gin_files: Sequence[str] = (), gin_bindings: Sequence[str] = (),
              gin_search_paths: Sequence[str] = (), finalize: bool = True,
              read_macros: Sequence[str] = ()) -> None:
  """Parses gin files then bindings (later ones override) into the global config.

  Configurables must already be registered (`import_configurables()`). Raises
  GinConfigError naming the file or binding for a missing file, an unknown
  configurable or parameter, a value gin cannot parse, or a macro set by
  `gin_bindings` (`--gin.NAME=...`) that no binding uses (a typo such as
  TRAIN_STEP for TRAIN_STEPS would otherwise change nothing); `read_macros` are
  macros the caller reads itself (gin.query_parameter), so they count as used.
  Returns None.
  """
  paths = search_paths(gin_search_paths)
  with _gin_search_paths(paths):
    for name in gin_files:
      path = resolve_gin_file(name, paths)
      try:
        gin.parse_config_file(path)
      except _PARSE_ERRORS as e:
        raise GinConfigError(f"in gin file {path}: {e}") from e
  for binding in gin_bindings:
    try:
      gin.parse_config(binding)
    except _PARSE_ERRORS as e:
      raise GinConfigError(f"gin binding {binding!r}: {e}") from e
  check_macros_used(gin_bindings, read_macros)
  if finalize:
    try:
      gin.finalize()
    except ValueError as e:  # a %gin.REQUIRED macro or value left unset
      raise GinConfigError(
          f"{e} (bind it in a gin file or with --gin.NAME=VALUE)") from e


_MACRO_BINDING = re.compile(r"^\s*([A-Za-z_][\w/]*)\s*=")


def macros_in_use() -> set[str]:
  """Returns the names of the macros that some binding of the global config
  references (`%NAME`)."""
  # pylint: disable=protected-access
  macro_fn = gin.get_configurable(gin.config.macro)
  return {ref.scoped_selector.rsplit("/", 1)[0]
          for ref in gin.config.iterate_references(gin.config._CONFIG, to=macro_fn)}


def check_macros_used(gin_bindings: Sequence[str], read_macros: Sequence[str] = ()
                      ) -> None:
  """Raises GinConfigError for the first binding of `gin_bindings` that sets a
  macro (`NAME = value`, no dot) which no binding of the global config uses and
  which is not in `read_macros`, naming the closest macro in use. Returns None."""
  used = macros_in_use() | set(read_macros)
  for binding in gin_bindings:
    match = _MACRO_BINDING.match(binding)
    if not match or match.group(1) in used:
      continue
    name = match.group(1)
    close = difflib.get_close_matches(name, sorted(used), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    known = ", ".join(sorted(used)) or "none"
    raise GinConfigError(
        f"--gin.{name}: no binding uses the macro {name}, so setting it would change "
        f"nothing; {hint}macros in use: {known}")


def missing_required(configurable, scope: str | None = None) -> list[str]:
  """Returns 'name.param' for each gin.REQUIRED parameter of `configurable` (a
  registered function, class or gin name) that the config, seen from `scope`,
  leaves unbound or binds to %gin.REQUIRED. Raises ValueError if not registered."""
  wrapper = gin.get_configurable(configurable)
  required = [name for name, p in inspect.signature(wrapper).parameters.items()
              if p.default is gin.REQUIRED]
  name = configurable if isinstance(configurable, str) else wrapper.__name__
  selector = f"{scope}/{name}" if scope else name
  query = f"{scope}/{wrapper.__module__}.{wrapper.__name__}" if scope else configurable
  bindings = gin.get_bindings(query, resolve_references=False)
  missing = []
  for param in required:
    value = bindings.get(param, gin.REQUIRED)
    if value is gin.REQUIRED or repr(value) == "%gin.REQUIRED":
      missing.append(f"{selector}.{param}")
  return missing


def check_required(*configurables, scope: str | None = None) -> None:
  """Raises GinConfigError naming every gin.REQUIRED parameter of `configurables`
  (functions, classes or their gin names) left unbound; returns None otherwise.

  Call it on the entry points right after `parse_gin`, before anything is compiled.
  """
  missing = [m for c in configurables for m in missing_required(c, scope)]
  if missing:
    raise GinConfigError(
        "required gin bindings not provided: " + ", ".join(missing)
        + " (bind them in a gin file or with --gin.NAME=VALUE)")


def write_operative_config(model_dir: str, filename: str = "config.gin") -> str:
  """Writes gin's operative config (values actually used so far) to
  `<model_dir>/<filename>`; returns that path."""
  path = epath.Path(model_dir) / filename
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(gin.operative_config_str())
  return os.fspath(path)
