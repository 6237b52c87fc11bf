"""Smoke test of benchmarks/moe_layer.py on a micro config."""
import importlib.util
import pathlib

import pytest

PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "moe_layer.py"
KEYS = {"config", "dispatcher", "tokens", "experts", "top_k", "capacity_factor", "ms",
        "dense_ms", "ratio_to_dense", "peak_bytes"}


@pytest.fixture(scope="module")
def bench():
  spec = importlib.util.spec_from_file_location("bench_moe_layer", PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("dispatcher", ["sort", "ragged_padded_dropless"])
def test_bench_row_has_the_keys(bench, dispatcher):
  shape = (16, 32, 4, 2, 64)
  dense, peak = bench.dense_ms(shape, runs=1, warmup=1)
  assert dense > 0 and peak > 0
  row = bench.bench_row("micro", shape, dispatcher, dense, runs=1, warmup=1)
  assert KEYS <= set(row)
  assert row["ms"] > 0 and row["peak_bytes"] > 0 and row["experts"] == 4
  assert (row["capacity_factor"] is None) == dispatcher.endswith("dropless")
