"""openmoe_jax: sparse Mixture-of-Experts language models in JAX/Flax.

Kept light on purpose: importing the package must not pull in jax, tensorflow or seqio.
"""
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


# A source checkout run without install: `openmoe_jax.tasks` is <checkout>/tasks.
from openmoe_jax import _source_tasks  # pylint: disable=g-import-not-at-top

_source_tasks.install()
