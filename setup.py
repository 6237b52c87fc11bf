"""Packaging for openmoe_jax.

Two top-level folders of the repository are installed inside the package:

- ``tasks/`` (seqio Task/Mixture registrations) becomes ``openmoe_jax.tasks``;
  there is never a bare top-level ``tasks`` package (a checkout run without
  install gets the same name from ``openmoe_jax/_source_tasks.py``).
- ``gin/`` (models/, objectives/, runs/, experiments/) becomes the data folder
  ``openmoe_jax/gin_configs``; ``openmoe_jax.gin_utils`` puts it on the gin search path.
"""
import os

import setuptools

HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
  """Returns __version__ read from openmoe_jax/__init__.py without importing it."""
  with open(os.path.join(HERE, "openmoe_jax", "__init__.py")) as f:
    for line in f:
      if line.startswith("__version__"):
        return line.split("=")[1].strip().strip("\"'")
  raise RuntimeError("__version__ not found in openmoe_jax/__init__.py")


def _packages(where, installed_as):
  """Returns `installed_as` plus a dotted name for each sub-folder of `where` ([] if
  `where` does not exist).

  Namespace discovery (folders without __init__.py count too) so that a wheel holds
  exactly what a source checkout can import.
  """
  if not os.path.isdir(os.path.join(HERE, where)):
    return []
  found = setuptools.find_namespace_packages(
      where=os.path.join(HERE, where), exclude=["*__pycache__*"])
  return [installed_as] + [f"{installed_as}.{p}" for p in found]


# Compatible ranges; the exact versions CI tests with are in constraints.txt
# (`pip install -e . -c constraints.txt`).
INSTALL_REQUIRES = [
    "jax>=0.10.2,<0.11",
    "jaxlib>=0.10.2,<0.11",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "seqio>=0.0.20",
    "tensorflow>=2.21,<2.22",
    "tensorflow-text>=2.21,<2.22",
    "tensorboard>=2.21,<2.22",
    "sentencepiece>=0.2.3,<0.3",
    "gin-config>=0.5.0",
    "clu>=0.0.12",
    "numpy>=2.0,<3",
    "matplotlib>=3.8",
    "safetensors>=0.4",
]

setuptools.setup(
    name="openmoe_jax",
    version=_version(),
    description="Sparse Mixture-of-Experts language models in JAX/Flax (OpenMoE recipes).",
    long_description=open(os.path.join(HERE, "README.md")).read()
    if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=(
        _packages("openmoe_jax", "openmoe_jax")
        + _packages("tasks", "openmoe_jax.tasks")
        + _packages("gin", "openmoe_jax.gin_configs")  # data only: *.gin files
    ),
    package_dir={
        "openmoe_jax.tasks": "tasks",
        "openmoe_jax.gin_configs": "gin",
    },
    package_data={"openmoe_jax.gin_configs": ["*.gin", "**/*.gin"]},
    install_requires=INSTALL_REQUIRES,
    extras_require={
        # libtpu (via jax[tpu]) lets tests compile for TPU topologies ahead of time.
        # torch and transformers: independent references for the Hugging Face
        # converters' tests (CPU is enough; constraints.txt pins a CPU-only torch).
        # filelock: jax's lock on the tests' shared compilation cache (conftest.py).
        "test": ["pytest>=9.0", "pytest-timeout>=2.3", "pytest-xdist>=3.6",
                 "jax[tpu]>=0.10.2,<0.11", "torch>=2.6", "transformers>=5.0,<6",
                 "filelock>=3.0"],
        "tpu": ["jax[tpu]>=0.10.2,<0.11"],
        # jax's CUDA 12 build (jax-cuda12-plugin with the CUDA wheels; jaxlib pinned
        # to jax's own version, as in constraints.txt). Not installed in CI.
        "gpu": ["jax[cuda12]>=0.10.2,<0.11"],
    },
    # Every program lives in openmoe_jax/cli/ (`python -m openmoe_jax.cli.<name>`).
    entry_points={
        "console_scripts": [
            "openmoe-train=openmoe_jax.cli.train:main",
            "openmoe-analyze=openmoe_jax.cli.analyze:main",
            "openmoe-params=openmoe_jax.cli.params:main",
            "openmoe-plan=openmoe_jax.cli.plan:main",
            "openmoe-sample=openmoe_jax.cli.sample:main",
            "openmoe-eval=openmoe_jax.cli.evaluate:main",
            "openmoe-upcycle=openmoe_jax.cli.upcycle:main",
            "openmoe-ablate=openmoe_jax.cli.ablate:main",
            "openmoe-convert=openmoe_jax.cli.convert:main",
        ],
    },
)
