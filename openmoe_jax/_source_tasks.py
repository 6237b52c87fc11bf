"""`openmoe_jax.tasks` in a source checkout that is not installed.

The product's layout keeps seqio tasks in the top-level `tasks/` folder, and
setup.py installs that folder as `openmoe_jax.tasks` (package_dir). With only
PYTHONPATH=<checkout> (no `pip install`), nothing maps `openmoe_jax.tasks` to
`<checkout>/tasks`; `install()` adds the one meta-path finder that does.

Why a finder and nothing plainer: a symlink `openmoe_jax/tasks -> ../tasks` breaks
on checkouts without symlinks (Windows) and doubles the package in wheels;
appending the checkout to `openmoe_jax.__path__` would make `openmoe_jax.tests`,
`openmoe_jax.setup` and the other top-level folders importable too. The finder maps
exactly one name, and only when this package sits in a checkout (setup.py beside
it, never in site-packages). It goes first on sys.meta_path, so the tasks always
come from the same tree as the package, even when another checkout of openmoe_jax
is installed in editable mode.
"""
import importlib.util
import os
import sys

PACKAGE = "openmoe_jax"
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS_DIR = os.path.join(CHECKOUT, "tasks")


class SourceTasksFinder:
  """Finds `openmoe_jax.tasks` in `<checkout>/tasks`."""

  @staticmethod
  def find_spec(fullname, path=None, target=None):
    """Returns the spec of `<checkout>/tasks` for `openmoe_jax.tasks`, else None."""
    del path, target
    if fullname != PACKAGE + ".tasks":
      return None
    return importlib.util.spec_from_file_location(
        fullname, os.path.join(TASKS_DIR, "__init__.py"),
        submodule_search_locations=[TASKS_DIR])


def install() -> None:
  """Puts SourceTasksFinder first on sys.meta_path when this package is a source
  checkout with tasks/ (once; a no-op for an installed package). Returns None."""
  in_checkout = (os.path.isfile(os.path.join(CHECKOUT, "setup.py"))
                 and os.path.isfile(os.path.join(TASKS_DIR, "__init__.py")))
  if in_checkout and not any(getattr(f, "__name__", None) == "SourceTasksFinder"
                             for f in sys.meta_path):
    sys.meta_path.insert(0, SourceTasksFinder)
