"""Test session setup: CPU with 8 emulated devices, shared data and compilation
caches, clean gin.

The environment variables must be set before jax (or tensorflow) is first imported,
which is why they sit at module level here.

Test oracles (NumPy references, e.g. moe_reference.py) live in this folder and are
imported as top-level modules (`from moe_reference import ...`): tests/ has no
__init__.py, so pytest puts it on sys.path. They are not library code.
"""
import atexit
import importlib.metadata
import os
import pathlib
import shutil
import tempfile


def _jaxlib_version():
  """Returns jaxlib's (major, minor) from its metadata, without importing it."""
  return tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])


os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# Test programs are tiny: LLVM's optimisation passes cost more compile time (about 3x
# on these models) than they save at run time.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA:CPU's older loop emitters for fusions compile these programs in less than half
# the time of the newer fusion emitters (two ablation arms: 12.4 s -> 5.6 s of
# compile, same losses); the HLO passes are the same either way. jaxlib 0.11 removed
# the flag (and aborts on an unknown one): set only where jaxlib is older.
if ("--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]
    and _jaxlib_version() < (0, 11)):
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

# One persistent compilation cache for the session, shared by both xdist workers and
# every subprocess they start (they inherit the environment): the end-to-end tests
# compile the same train and eval steps in several processes (run, kill, relaunch).
# About a third off those tests on 2 cores. A fresh folder per session, so what
# runs here is what CI runs; the size limit turns on jax's file lock, so no process
# reads an entry another one is still writing.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="openmoe_jax_xla_")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"],
                  ignore_errors=True)

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
