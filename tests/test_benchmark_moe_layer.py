"""benchmarks/moe_layer.py: every path it times computes the same MoE layer (checked
against an independent dense oracle), plus smoke tests of its rows and sweep."""
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "moe_layer.py"
KEYS = {"config", "dispatcher", "tokens", "experts", "top_k", "capacity_factor", "ms",
        "dense_ms", "ratio_to_dense", "peak_bytes"}
# (d_model, d_ff, experts, top_k, tokens): 16 experts at a mean load of 8 choices and
# 10 slots each, so the capacity paths drop choices.
SHAPE = (16, 32, 16, 2, 64)


@pytest.fixture(scope="module")
def bench():
  spec = importlib.util.spec_from_file_location("bench_moe_layer", PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _swiglu_enf(x_nd, wi_0, wi_1, wo):
  """Returns [E, n, d]: every token through every expert's swiglu MLP."""
  h_enf = (jax.nn.silu(jnp.einsum("nd,edf->enf", x_nd, wi_0))
           * jnp.einsum("nd,edf->enf", x_nd, wi_1))
  return jnp.einsum("enf,efd->end", h_enf, wo)


def _routing(probs_ne, top_k, capacity):
  """Returns (expert [n, k], kept [n, k]): top-k choices served in ST-MoE order
  (every 1st choice before any 2nd, then by position) while the expert has room."""
  expert_nk = np.argsort(-probs_ne, axis=1, kind="stable")[:, :top_k]
  kept_nk = np.zeros(expert_nk.shape, bool)
  load_e = np.zeros(probs_ne.shape[1], int)
  for j in range(top_k):
    for t in range(probs_ne.shape[0]):
      e = expert_nk[t, j]
      kept_nk[t, j] = load_e[e] < capacity
      load_e[e] += 1
  return expert_nk, kept_nk


def _oracle(params, x_btd, ct_btd, top_k, capacity):
  """Returns (loss, (param grads, x grad), choices dropped) of sum(MoE(x) * ct),
  computing every expert on every token densely and combining the kept choices
  with their (not renormalised) softmax router probabilities."""
  p = params["params"]
  num_experts = p["router"]["w"].shape[1]
  probs = lambda x_nd, w: jax.nn.softmax(x_nd @ w, axis=-1)
  expert_nk, kept_nk = _routing(np.asarray(probs(x_btd[0], p["router"]["w"])),
                                top_k, capacity)
  mask_nke = jax.nn.one_hot(expert_nk, num_experts) * kept_nk[..., None]

  def loss(params, x_btd, ct_btd):
    q = params["params"]
    combine_ne = jnp.einsum("nke,ne->ne", mask_nke, probs(x_btd[0], q["router"]["w"]))
    y_end = _swiglu_enf(x_btd[0], q["experts"]["wi_0"], q["experts"]["wi_1"],
                        q["experts"]["wo"])
    return jnp.sum(jnp.einsum("ne,end->nd", combine_ne, y_end) * ct_btd[0])

  value, grads = jax.value_and_grad(loss, argnums=(0, 1))(params, x_btd, ct_btd)
  return value, grads, int((~kept_nk).sum())


@pytest.mark.parametrize("dispatcher", [
    "einsum", "sort", "ragged_padded_cf", "auto", "ragged_padded_dropless",
    "ragged_dot_dropless"])
def test_each_timed_path_computes_the_oracle_moe_layer(bench, dispatcher):
  assert set(bench.DISPATCHERS) == {
      "einsum", "sort", "ragged_padded_cf", "auto", "ragged_padded_dropless",
      "ragged_dot_dropless"}
  d_model, d_ff, experts, top_k, tokens = SHAPE
  fn, params, x_btd, ct_btd = bench.moe_problem(SHAPE, dispatcher)
  dropless = dispatcher.endswith("dropless")
  # The docstring's convention: cf x tokens x top_k / E slots per expert.
  capacity = tokens if dropless else round(
      bench.CAPACITY_FACTOR * tokens * top_k / experts)
  want, want_grads, dropped = _oracle(params, x_btd, ct_btd, top_k, capacity)
  assert (dropped == 0) == dropless
  got, got_grads = jax.jit(fn)(params, x_btd, ct_btd)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5),
               got_grads, want_grads)


def test_dense_baseline_has_the_active_width_and_computes_a_swiglu_mlp(bench):
  d_model, d_ff, experts, top_k, tokens = SHAPE
  fn, params, x_btd, ct_btd = bench.dense_problem(SHAPE)
  p = params["params"]
  assert (p["wi_0"].shape, p["wi_1"].shape, p["wo"].shape) == (
      (d_model, top_k * d_ff), (d_model, top_k * d_ff), (top_k * d_ff, d_model))
  got, _ = jax.jit(fn)(params, x_btd, ct_btd)
  want = jnp.sum(_swiglu_enf(x_btd[0], p["wi_0"][None], p["wi_1"][None],
                             p["wo"][None])[0] * ct_btd[0])
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("dispatcher", ["sort", "ragged_padded_dropless"])
def test_bench_row_smoke(bench, dispatcher):
  """Smoke test: a row has its keys and the shape's values; timings and peak bytes
  are machine-dependent, so only their sign is checked."""
  shape = (16, 32, 4, 2, 64)
  dense, peak = bench.dense_ms(shape, runs=1, warmup=1)
  assert dense > 0 and peak > 0
  row = bench.bench_row("micro", shape, dispatcher, dense, runs=1, warmup=1)
  assert KEYS <= set(row)
  assert row["ms"] > 0 and row["peak_bytes"] > 0
  assert (row["tokens"], row["experts"], row["top_k"], row["d_model"], row["d_ff"]) == (
      64, 4, 2, 16, 32)
  assert row["capacity_factor"] == (None if dispatcher.endswith("dropless")
                                    else bench.CAPACITY_FACTOR)
  assert row["ratio_to_dense"] == pytest.approx(row["ms"] / row["dense_ms"], rel=0.01)


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
