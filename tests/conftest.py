"""Test session setup: CPU with 8 emulated devices, a shared data cache, clean gin.

The environment variables must be set before jax (or tensorflow) is first imported,
which is why they sit at module level here.

Test oracles (NumPy references, e.g. moe_reference.py) live in this folder and are
imported as top-level modules (`from moe_reference import ...`): tests/ has no
__init__.py, so pytest puts it on sys.path. They are not library code.
"""
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# Test programs are tiny: LLVM's optimisation passes cost more compile time (about 3x
# on these models) than they save at run time.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# One cache for the whole session (and across sessions) so the embedded corpus and
# the vocabulary are built once.
os.environ.setdefault("OPENMOE_JAX_CACHE", str(REPO_ROOT / ".cache" / "test"))
pathlib.Path(os.environ["OPENMOE_JAX_CACHE"]).mkdir(parents=True, exist_ok=True)

import gin  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top


@pytest.fixture(autouse=True)
def _clear_gin_config():
  """Gives every test an empty, unlocked gin config."""
  gin.clear_config()
  yield
  gin.clear_config()
