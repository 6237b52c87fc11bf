"""openmoe_jax: sparse Mixture-of-Experts language models in JAX/Flax.

Kept light on purpose: importing the package must not pull in jax, tensorflow or seqio.
"""
import importlib.util as _importlib_util
import os as _os
import sys as _sys

__version__ = "0.1.0"

# Before any module of the package imports jax: choose the CPU when libtpu is
# installed but no TPU is attached, and quiet native log noise in our programs.
from openmoe_jax.cli import environment as _environment  # pylint: disable=g-import-not-at-top

_environment.prepare_process()


def __getattr__(name):
  """`openmoe_jax.load_model` without importing jax at package import."""
  if name == "load_model":
    from openmoe_jax.loading import load_model  # pylint: disable=g-import-not-at-top
    return load_model
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_REPO = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_TASKS_DIR = _os.path.join(_REPO, "tasks")


class _SourceTasksFinder:
  """Finds `openmoe_jax.tasks` in `<repo>/tasks` when running from a source checkout.

  setup.py installs the top-level tasks/ folder as `openmoe_jax.tasks`; with only
  PYTHONPATH=<repo> (no install) that mapping does not exist, so this finder
  provides it. It sits last on sys.meta_path, after the installed mapping.
  """

  @staticmethod
  def find_spec(fullname, path=None, target=None):
    del path, target
    if fullname != __name__ + ".tasks":
      return None
    return _importlib_util.spec_from_file_location(
        fullname, _os.path.join(_TASKS_DIR, "__init__.py"),
        submodule_search_locations=[_TASKS_DIR])


# Only a checkout has setup.py beside the package (not site-packages).
if (_os.path.isfile(_os.path.join(_REPO, "setup.py"))
    and _os.path.isfile(_os.path.join(_TASKS_DIR, "__init__.py"))
    and not any(isinstance(f, type) and f.__name__ == "_SourceTasksFinder"
                for f in _sys.meta_path)):
  _sys.meta_path.append(_SourceTasksFinder)
