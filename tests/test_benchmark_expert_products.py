"""benchmarks/expert_products.py: both sides of each pair compute the product they
are named for (checked against per-expert NumPy), for XLA and for NumPy's BLAS,
plus a smoke test of its rows."""
import json

import numpy as np
import pytest

import benchmark_modules

ROWS, D, F, E = 5, 8, 6, 3


@pytest.fixture(scope="module")
def bench():
  return benchmark_modules.load("expert_products")


def _expected(kind, args):
  """Returns (batched result, 2-D result) per expert with NumPy in float64."""
  a, b = (np.asarray(v, np.float64) for v in args)
  if kind == "forward":  # x [E, r, d], w [E, d, f]
    per_expert = np.stack([a[e] @ b[e] for e in range(E)])
    return per_expert, a.reshape(E * ROWS, D) @ b[0]
  if kind == "input_grad":  # dy [E, r, f], w [E, d, f]
    per_expert = np.stack([a[e] @ b[e].T for e in range(E)])
    return per_expert, a.reshape(E * ROWS, F) @ b[0].T
  # weight_grad: x [E, r, d], dy [E, r, f]
  per_expert = np.stack([a[e].T @ b[e] for e in range(E)])
  return per_expert, a.reshape(E * ROWS, D).T @ b.reshape(E * ROWS, F)


@pytest.mark.parametrize("library", ["xla", "numpy"])
@pytest.mark.parametrize("kind", ["forward", "input_grad", "weight_grad"])
def test_both_sides_compute_the_named_product(bench, kind, library):
  make = bench.problem if library == "xla" else bench.numpy_problem
  batched, args, dense, dense_args = make(kind, ROWS, D, F, E)
  want_batched, want_dense = _expected(kind, args)
  np.testing.assert_allclose(np.asarray(batched(*args)), want_batched,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dense(*dense_args)), want_dense,
                             rtol=1e-5, atol=1e-5)
  # The same multiply-adds on both sides: output size x contraction length.
  batched_k, dense_k = {"forward": (D, D), "input_grad": (F, F),
                        "weight_grad": (ROWS, E * ROWS)}[kind]
  assert want_batched.size * batched_k == want_dense.size * dense_k == E * ROWS * D * F


def test_rows_and_errors(bench, capsys):
  bench.main(["--json", "--rounds", "2", "--shapes", f"{ROWS},{D},{F},{E}"])
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  kinds = ["forward", "input_grad", "weight_grad"]
  assert [r["product"] for r in rows] == kinds * 2
  blas = bench.blas_name()
  assert [r["library"] for r in rows] == ["xla"] * 3 + [f"numpy ({blas})"] * 3
  assert blas != "unknown"
  bench.main(["--json", "--rounds", "1", "--libraries", "numpy",
              "--shapes", f"{ROWS},{D},{F},{E}"])
  assert [json.loads(line)["library"] for line in capsys.readouterr().out.splitlines()
          ] == [f"numpy ({blas})"] * 3
  for row in rows:
    assert row["ms"] > 0 and row["ms_2d"] > 0 and row["ratio"] > 0
    assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    assert row["gflops"] == pytest.approx(2 * E * ROWS * D * F / row["ms"] / 1e6,
                                          rel=1e-2, abs=0.1)
    assert (row["rows_per_expert"], row["d"], row["f"], row["experts"]) == (ROWS, D, F, E)
  with pytest.raises(SystemExit):
    bench.main(["--shapes", "1,2,3"])
  assert "rows,d,f,E" in capsys.readouterr().err
  for bad in ("cuda", "xla,cuda", ","):
    with pytest.raises(SystemExit):
      bench.main(["--libraries", bad])
    assert f"{bad!r}: name one or more of xla, numpy" in capsys.readouterr().err
  with pytest.raises(ValueError, match="unknown product"):
    bench.problem("backward", ROWS, D, F, E)
  with pytest.raises(ValueError, match="unknown library"):
    bench.time_shape(ROWS, D, F, E, rounds=1, library="cuda")


def test_xla_rows_run_compiled_programs_and_numpy_rows_none(bench, monkeypatch):
  compiled = []
  real = bench.timing.compile_fn
  monkeypatch.setattr(bench.timing, "compile_fn",
                      lambda fn, *args: compiled.append(fn) or real(fn, *args))
  bench.time_shape(ROWS, D, F, E, rounds=1, library="numpy")
  assert compiled == []
  bench.time_shape(ROWS, D, F, E, rounds=1, library="xla")
  assert len(compiled) == 6  # batched and 2-D, per product
