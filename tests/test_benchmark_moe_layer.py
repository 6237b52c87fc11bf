"""Smoke test of benchmarks/moe_layer.py on a micro config."""
import importlib.util
import json
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


def test_sweep_prints_json_rows(bench, monkeypatch, capsys):
  assert [s[4] for c, s in bench.sweep_shapes() if c == "tokens_sweep"] == [
      1024, 2048, 4096, 8192, 16384]
  assert [s[2] for c, s in bench.sweep_shapes() if c == "experts_sweep"] == [
      16, 32, 64, 128, 256]
  monkeypatch.setattr(bench, "SWEEP_BASE", (16, 32, 4, 2, 64))
  monkeypatch.setattr(bench, "SWEEP_TOKENS", (32,))
  monkeypatch.setattr(bench, "SWEEP_EXPERTS", (8,))
  bench.main(["--sweep", "--json", "--runs", "1", "--warmup", "0",
              "--dispatchers", "einsum,sort", "--max_einsum_elements", "0"])
  out = capsys.readouterr()
  rows = [json.loads(line) for line in out.out.splitlines()]
  assert all(KEYS <= set(row) for row in rows)
  assert [(r["config"], r["dispatcher"], r["tokens"], r["experts"]) for r in rows] == [
      ("tokens_sweep", "sort", 32, 4), ("experts_sweep", "sort", 64, 8)]
  assert out.err.count("skip einsum") == 2
