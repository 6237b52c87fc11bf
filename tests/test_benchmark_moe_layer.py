"""benchmarks/moe_layer.py: every path it times computes the same MoE layer (checked
against an independent dense oracle), plus smoke tests of its rows and sweep."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import benchmark_modules

KEYS = {"config", "dispatcher", "tokens", "experts", "top_k", "capacity_factor", "ms",
        "ms_min", "ms_max", "dense_ms", "dense_ms_min", "dense_ms_max", "rounds",
        "ratio_to_dense", "ratio_to_dense_min", "ratio_to_dense_max", "useful_flops",
        "dense_useful_flops", "flops_source", "compiled_flops", "peak_fraction",
        "dense_peak_fraction", "peak_flops_start", "peak_flops_end", "loadavg_start",
        "loadavg_end", "peak_bytes", "dense_peak_bytes"}
# (d_model, d_ff, experts, top_k, tokens): 16 experts at a mean load of 8 choices and
# 10 slots each, so the capacity paths drop choices.
SHAPE = (16, 32, 16, 2, 64)


@pytest.fixture(scope="module")
def bench():
  return benchmark_modules.load("moe_layer")


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
    "einsum", "sort", "ragged_padded_cf", "block_cf", "auto", "ragged_padded_dropless",
    "ragged_dot_dropless", "block_dropless"])
def test_each_timed_path_computes_the_oracle_moe_layer(bench, dispatcher):
  assert set(bench.DISPATCHERS) == {
      "einsum", "sort", "ragged_padded_cf", "block_cf", "auto", "ragged_padded_dropless",
      "ragged_dot_dropless", "block_dropless"}
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


def test_floor_is_each_expert_on_its_own_balanced_rows(bench):
  """The floor path: expert e's swiglu MLP on its tokens x top_k / E rows, nothing
  else (checked per expert in float64 NumPy, values and input gradient)."""
  d_model, d_ff, experts, top_k, tokens = SHAPE
  fn, weights, x_end, ct_end = bench.floor_problem(SHAPE)
  rows = tokens * top_k // experts
  assert x_end.shape == ct_end.shape == (experts, rows, d_model)
  assert weights.wi_0.shape == (experts, d_model, d_ff)
  assert weights.wo.shape == (experts, d_ff, d_model)
  value, (_, dx_end) = jax.jit(fn)(weights, x_end, ct_end)
  f64 = lambda a: np.asarray(a, np.float64)
  silu = lambda h: h / (1 + np.exp(-h))
  want, want_dx = 0.0, []
  for e in range(experts):
    x, ct = f64(x_end[e]), f64(ct_end[e])
    w0, w1, wo = f64(weights.wi_0[e]), f64(weights.wi_1[e]), f64(weights.wo[e])
    h0, h1 = x @ w0, x @ w1
    want += np.sum((silu(h0) * h1) @ wo * ct)
    da = ct @ wo.T
    sig = 1 / (1 + np.exp(-h0))
    dh0 = da * h1 * (sig + h0 * sig * (1 - sig))
    want_dx.append(dh0 @ w0.T + (da * silu(h0)) @ w1.T)
  np.testing.assert_allclose(value, want, rtol=1e-5)
  np.testing.assert_allclose(dx_end, np.stack(want_dx), rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="not a multiple of E"):
    bench.floor_problem((16, 32, 16, 1, 8))


def test_router_only_row_runs_the_router_and_no_expert(bench):
  """`router_only`: y = x x (sum of the kept gates), capacity routing as the oracle
  serves it; only the router's gradient comes back."""
  d_model, d_ff, experts, top_k, tokens = SHAPE
  fn, params, x_btd, ct_btd = bench.moe_problem(SHAPE, bench.ROUTER)
  value, (router_grads, dx_btd) = jax.jit(fn)(params, x_btd, ct_btd)
  assert jax.tree.structure(router_grads) == jax.tree.structure(
      params["params"]["router"])
  capacity = round(bench.CAPACITY_FACTOR * tokens * top_k / experts)
  w = params["params"]["router"]["w"]
  expert_nk, kept_nk = _routing(np.asarray(jax.nn.softmax(x_btd[0] @ w)), top_k,
                                capacity)
  assert (~kept_nk).sum() > 0
  mask_nke = jax.nn.one_hot(expert_nk, experts) * kept_nk[..., None]

  def oracle(w, x_nd):
    gates_n = jnp.einsum("nke,ne->n", mask_nke, jax.nn.softmax(x_nd @ w))
    return jnp.sum(x_nd * gates_n[:, None] * ct_btd[0])

  want, (want_dw, want_dx) = jax.value_and_grad(oracle, argnums=(0, 1))(w, x_btd[0])
  np.testing.assert_allclose(value, want, rtol=1e-5)
  np.testing.assert_allclose(router_grads["w"], want_dw, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(dx_btd[0], want_dx, rtol=1e-4, atol=1e-6)


def test_time_shape_smoke(bench):
  """Smoke test: rows have their keys and the shape's values; timings and peak bytes
  are machine-dependent, so only their sign and their consistency are checked."""
  shape = (16, 32, 4, 2, 64)
  dispatchers = ["sort", "ragged_padded_dropless", bench.FLOOR, bench.ROUTER]
  rows = bench.time_shape("micro", shape, dispatchers, rounds=3, warmup=1)
  rows = bench.finish_rows(rows, 2e9, 1e9, [1.0, 2.0, 3.0], None)
  assert [r["dispatcher"] for r in rows] == dispatchers
  for row in rows:
    assert KEYS <= set(row)
    assert row["rounds"] == 3 and row["flops_source"] == "analytic"
    assert 0 < row["ms_min"] <= row["ms"] <= row["ms_max"]
    assert 0 < row["dense_ms_min"] <= row["dense_ms"] <= row["dense_ms_max"]
    assert row["peak_bytes"] > 0
    assert (row["tokens"], row["experts"], row["top_k"], row["d_model"], row["d_ff"]) == (
        64, 4, 2, 16, 32)
    floor, router = (row["dispatcher"] == bench.FLOOR,
                     row["dispatcher"] == bench.ROUTER)
    assert row["capacity_factor"] == (
        None if floor or row["dispatcher"].endswith("dropless")
        else bench.CAPACITY_FACTOR)
    assert (row["ratio_to_dense_min"] <= row["ratio_to_dense"]
            <= row["ratio_to_dense_max"])
    # Per-round ratios bracket the ratio of the extreme times.
    assert row["ratio_to_dense_min"] <= row["ms_max"] / row["dense_ms_min"] + 1e-3
    assert row["ratio_to_dense_max"] >= row["ms_min"] / row["dense_ms_max"] - 1e-3
    # 6 x tokens x (k x 3 d f + d E) and 6 x tokens x 3 d (k f), counted by hand;
    # the floor has no router, the router row no expert.
    assert row["useful_flops"] == 6 * 64 * ((0 if router else 2 * 3 * 16 * 32)
                                            + (0 if floor else 16 * 4))
    assert row["dense_useful_flops"] == 6 * 64 * 3 * 16 * 64
    # Fractions of the higher of the two peaks.
    assert row["peak_fraction"] == pytest.approx(
        row["useful_flops"] / (row["ms"] * 1e-3) / 2e9, rel=1e-2)
    assert row["dense_peak_fraction"] == pytest.approx(
        row["dense_useful_flops"] / (row["dense_ms"] * 1e-3) / 2e9, rel=1e-2)
    assert (row["peak_flops_start"], row["peak_flops_end"]) == (2e9, 1e9)
    assert (row["loadavg_start"], row["loadavg_end"]) == ([1.0, 2.0, 3.0], None)


def test_each_path_is_timed_in_pairs_with_dense_and_ratios_taken_per_pair(
    bench, monkeypatch):
  """Each path alternates with the baseline alone (dense, a, dense, a, ..., then
  dense, b, ...) and the ratio is the median of per-pair ratios: a load spike in one
  pair moves no ratio."""
  order = []
  record = lambda n: (lambda: order.append(n))
  times = bench.timing.paired_ms(record("dense"), {"a": record("a"), "b": record("b")},
                                 rounds=3, warmup=1)
  assert order == ["dense", "a"] * 4 + ["dense", "b"] * 4
  assert list(times) == ["a", "b"]
  assert all(len(side) == 3 and min(side) >= 0 for pair in times.values()
             for side in pair)
  # Pair 2 ran 10x slower for both sides: per-pair ratios stay 2.
  dense, slow = [1.0, 1.0, 10.0, 1.0], [2.0, 2.0, 20.0, 2.0]
  ratios = bench.timing.per_round_ratios(slow, dense)
  assert ratios == [2.0] * 4
  assert bench.timing.spread(ratios, "r") == {"r": 2.0, "r_min": 2.0, "r_max": 2.0}
  # Load rose after pair 0's dense call and fell before pair 2's: the ratio of the
  # medians would say 10x, the median of the per-pair ratios says 2x.
  ratios = bench.timing.per_round_ratios([2.0, 10.0, 10.0], [1.0, 1.0, 5.0])
  assert bench.timing.spread(ratios, "r")["r"] == 2.0
  assert bench.timing.spread([3.0, 1.0, 2.0, 10.0], "ms") == {
      "ms": 2.5, "ms_min": 1.0, "ms_max": 10.0}
  clock = iter([0.0, 0.001, 0.0, 0.003, 0.0, 0.002, 0.0, 0.006])
  monkeypatch.setattr(bench.timing.time, "perf_counter", lambda: next(clock))
  times = bench.timing.paired_ms(lambda: 0, {"a": lambda: 0}, 2, 0)
  assert times == {"a": (pytest.approx([1.0, 2.0]), pytest.approx([3.0, 6.0]))}


def test_min_sample_ms_times_back_to_back_calls_and_divides(bench, monkeypatch):
  """On an accelerator a sample is `repeat` queued calls, the last waited for: the
  clock is read once around all of them and the time divided by `repeat`."""
  clock = iter([0.0, 0.012])
  monkeypatch.setattr(bench.timing.time, "perf_counter", lambda: next(clock))
  calls = []
  assert bench.timing.call_ms(lambda: calls.append(1), repeat=4) == pytest.approx(3.0)
  assert len(calls) == 4
  # One call timed at 0.3 ms: 20 ms needs 67 calls; 0 needs one and no timing call.
  clock = iter([0.0, 0.0003])
  assert bench.timing.repeats_for(lambda: 0, 20.0) == 67
  clock = iter([0.0, 0.0003])
  assert bench.timing.repeats_for(lambda: 0, 0.5) == 2  # any positive minimum counts
  clock = iter([0.0, 0.030])  # one call already lasts the minimum
  assert bench.timing.repeats_for(lambda: 0, 20.0) == 1
  clock = iter([0.0, 0.0])  # a call faster than the clock: read as 1 us
  assert bench.timing.repeats_for(lambda: 0, 20.0) == 20000
  assert bench.timing.repeats_for(lambda: 1 / 0, 0.0) == 1
  # paired_ms: each side's repeats come from its own timed call, after the warmup.
  monkeypatch.undo()
  order = []
  record = lambda n: (lambda: order.append(n))
  monkeypatch.setattr(bench.timing, "repeats_for",
                      lambda call, ms: {"dense": 2, "a": 3}[call.__name__] if ms else 1)
  named = lambda n: type("Call", (), {"__call__": staticmethod(record(n)),
                                      "__name__": n})()
  times = bench.timing.paired_ms(named("dense"), {"a": named("a")}, rounds=2,
                                 warmup=1, min_sample_ms=20.0)
  assert order == ["dense", "a"] + (["dense"] * 2 + ["a"] * 3) * 2
  assert [len(side) for side in times["a"]] == [2, 2]


def test_compile_fn_reads_what_each_backend_reports(bench, monkeypatch):
  """Peak bytes are temp + arguments; FLOPs come from a dict or (older jax) a
  list of dicts; a backend that reports nothing gives None, not an error."""
  fn, x = lambda a: a @ a, jnp.ones((8, 8))
  compiled, peak, counted = bench.timing.compile_fn(fn, x)
  mem = compiled.memory_analysis()
  assert peak == mem.temp_size_in_bytes + mem.argument_size_in_bytes
  assert counted == compiled.cost_analysis()["flops"] > 0
  for reported, want in [(None, None), ([], None), ({}, None), ({"bytes": 1.0}, None),
                         ([{"flops": 7.0}], 7.0), ({"flops": 5}, 5.0)]:
    fake = type("Compiled", (), {"memory_analysis": lambda self: None,
                                 "cost_analysis": lambda self, r=reported: r})()
    lowered = type("Lowered", (), {"compile": lambda self, c=fake: c})()
    monkeypatch.setattr(bench.timing.jax, "jit", lambda f, l=lowered: type(
        "Jitted", (), {"lower": lambda self, *a: l})())
    assert bench.timing.compile_fn(fn, x)[1:] == (None, want), reported
    monkeypatch.undo()


def test_sweep_prints_json_rows_then_the_growth_laws(bench, monkeypatch, capsys):
  assert [s[4] for c, s in bench.sweep_shapes() if c == "tokens_sweep"] == [
      1024, 2048, 4096, 8192, 16384]
  assert [s[2] for c, s in bench.sweep_shapes() if c == "experts_sweep"] == [
      8, 16, 32, 64, 128, 256]
  assert [s[3] for c, s in bench.sweep_shapes() if c == "top_k_sweep"] == [1, 2, 4, 8]
  monkeypatch.setattr(bench, "SWEEP_BASE", (16, 32, 4, 2, 64))
  monkeypatch.setattr(bench, "SWEEP_TOKENS", (32,))
  monkeypatch.setattr(bench, "SWEEP_EXPERTS", (8,))
  monkeypatch.setattr(bench, "SWEEP_TOP_K", (1, 4))
  monkeypatch.setattr(bench.timing, "matmul_peak", lambda dtype: 1e9)
  bench.main(["--sweep", "--json", "--rounds", "2", "--warmup", "0",
              "--dispatchers", "einsum,sort", "--max_einsum_elements", "0"])
  out = capsys.readouterr()
  lines = [json.loads(line) for line in out.out.splitlines()]
  rows = [line for line in lines if "growth" not in line]
  assert all(KEYS <= set(row) and row["rounds"] == 2 for row in rows)
  assert [(r["config"], r["dispatcher"], r["tokens"], r["experts"], r["top_k"])
          for r in rows] == [("tokens_sweep", "sort", 32, 4, 2),
                             ("experts_sweep", "sort", 64, 8, 2),
                             ("top_k_sweep", "sort", 64, 4, 1),
                             ("top_k_sweep", "sort", 64, 4, 4)]
  assert out.err.count("skip einsum") == 4
  # After the rows: the growth laws, one per sweep and path (dense included).
  laws = lines[len(rows):]
  assert [(g["growth"], g["path"], g["from"], g["to"]) for g in laws] == [
      ("tokens_sweep", "sort", 32, 32), ("tokens_sweep", "dense", 32, 32),
      ("experts_sweep", "sort", 8, 8), ("experts_sweep", "dense", 8, 8),
      ("top_k_sweep", "sort", 1, 4), ("top_k_sweep", "dense", 1, 4)]
  k1, k4 = rows[2], rows[3]
  assert laws[4]["ms_exponent"] == pytest.approx(
      math.log(k4["ms"] / k1["ms"]) / math.log(4), abs=1e-3)
  assert laws[5]["peak_bytes_exponent"] == pytest.approx(
      math.log(k4["dense_peak_bytes"] / k1["dense_peak_bytes"]) / math.log(4), abs=1e-3)
  assert laws[0]["ms_exponent"] is None  # one point: no law


def test_growth_laws_by_hand(bench):
  """Exponents of made-up sweep rows: time x4 and memory x2 when x doubles twice
  gives a = 1 and 0.5 (first and last point; the middle one is not on that law);
  the dense series comes from the dense columns, once per x."""
  def row(config, path, x, ms, peak, dense_ms, dense_peak):
    shape = (dict(tokens=4096, experts=64, top_k=x) if config == "top_k_sweep"
             else dict(tokens=x, experts=64, top_k=2))
    return dict(config=config, dispatcher=path, d_model=8, d_ff=8, ms=ms,
                peak_bytes=peak, dense_ms=dense_ms, dense_peak_bytes=dense_peak, **shape)

  rows = [row("tokens_sweep", "sort", 1024, 10.0, 100, 5.0, 50),
          row("tokens_sweep", "block_cf", 1024, 20.0, 100, 5.5, 50),
          # A middle point off the end points' law: the law joins first and last.
          row("tokens_sweep", "sort", 2048, 13.0, 900, 7.0, 60),
          row("tokens_sweep", "sort", 4096, 40.0, 200, 80.0, 800),
          row("tokens_sweep", "block_cf", 4096, 20.0, 400, 90.0, 800),
          row("top_k_sweep", "sort", 1, 3.0, 8, 1.0, 1),
          row("top_k_sweep", "sort", 8, 24.0, 8, 8.0, 1),
          row("no_sweep", "sort", 2, 1.0, 1, 1.0, 1)]
  laws = {(g["growth"], g["path"]): g for g in bench.growth_laws(rows)}
  assert list(laws) == [("tokens_sweep", "sort"), ("tokens_sweep", "dense"),
                        ("tokens_sweep", "block_cf"), ("top_k_sweep", "sort"),
                        ("top_k_sweep", "dense")]
  assert laws["tokens_sweep", "sort"]["ms_exponent"] == pytest.approx(1.0)
  assert laws["tokens_sweep", "sort"]["peak_bytes_exponent"] == pytest.approx(0.5)
  assert laws["tokens_sweep", "block_cf"]["ms_exponent"] == pytest.approx(0.0)
  assert laws["tokens_sweep", "block_cf"]["peak_bytes_exponent"] == pytest.approx(1.0)
  # Dense from the first row at each x: 5 -> 80 ms (a = 2), 50 -> 800 bytes (a = 2).
  assert laws["tokens_sweep", "dense"]["ms_exponent"] == pytest.approx(2.0)
  assert laws["tokens_sweep", "dense"]["peak_bytes_exponent"] == pytest.approx(2.0)
  assert (laws["tokens_sweep", "dense"]["from"], laws["tokens_sweep", "dense"]["to"]) == (
      1024, 4096)
  assert laws["top_k_sweep", "sort"]["ms_exponent"] == pytest.approx(1.0)
  assert laws["top_k_sweep", "sort"]["peak_bytes_exponent"] == pytest.approx(0.0)
  assert laws["top_k_sweep", "dense"]["ms_exponent"] == pytest.approx(1.0)


def test_synthetic_batch_is_next_token_prediction_over_real_tokens(bench):
  batch = bench.timing.synthetic_batch(50, 3, 16)
  tokens, targets = batch["decoder_input_tokens"], batch["decoder_target_tokens"]
  assert tokens.shape == targets.shape == (3, 16) and tokens.dtype == np.int32
  np.testing.assert_array_equal(targets[:, :-1], tokens[:, 1:])  # the next token
  assert tokens.min() >= 1 and tokens.max() < 50  # no padding id 0
  assert (batch["decoder_loss_weights"] == 1).all()
  assert (batch["decoder_segment_ids"] == 1).all()
  np.testing.assert_array_equal(batch["decoder_positions"], np.tile(np.arange(16), (3, 1)))


def test_parse_shapes_takes_positive_integers_and_refuses_any_bad_shape(bench):
  fields = ("d_model", "d_ff", "experts", "top_k", "tokens")
  parse = lambda text: bench.timing.parse_shapes(text, fields)
  assert parse("16,32,4,2,64;16,32,6,2,64") == [(16, 32, 4, 2, 64), (16, 32, 6, 2, 64)]
  assert parse("1,1,1,1,1") == [(1, 1, 1, 1, 1)]  # 1 is positive
  for bad in ("16,32,0,2,64", "16,32,4,2,64;16,32,-1,2,64", "16,32,4,2", "",
              "16,32,4,2,64;x"):
    with pytest.raises(bench.argparse.ArgumentTypeError, match="positive integers"):
      parse(bad)


def test_own_shapes_name_their_rows_and_bad_ones_are_refused(bench, monkeypatch, capsys):
  monkeypatch.setattr(bench.timing, "matmul_peak", lambda dtype: 1e9)
  bench.main(["--json", "--rounds", "1", "--warmup", "0", "--shapes",
              "16,32,4,2,64;16,32,6,2,64", "--dispatchers", f"sort,{bench.FLOOR}"])
  out = capsys.readouterr()
  rows = [json.loads(line) for line in out.out.splitlines()]
  assert [(r["config"], r["dispatcher"], r["experts"], r["tokens"]) for r in rows] == [
      ("d16_f32_e4_k2_t64", "sort", 4, 64), ("d16_f32_e4_k2_t64", bench.FLOOR, 4, 64),
      ("d16_f32_e6_k2_t64", "sort", 6, 64)]
  # 64 x 2 rows do not split evenly over 6 experts: no floor row, and a note says so.
  assert f"skip {bench.FLOOR}" in out.err
  for bad in (["--shapes", "16,32,4,2"], ["--shapes", "16,32,4,8,64"],
              ["--shapes", "a,b,c,d,e"], ["--configs", "d1_f1_e1_k1"]):
    with pytest.raises(SystemExit):
      bench.main(bad)
    assert "error" in capsys.readouterr().err
