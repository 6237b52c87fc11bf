"""Loads a script of benchmarks/ as a module for its tests (benchmarks/ is not a
package of the library)."""
import importlib.util
import pathlib

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
  """Returns benchmarks/<name>.py, executed as the module `bench_<name>`."""
  spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
