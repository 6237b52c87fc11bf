"""benchmarks/train_step.py: each variant is the gin run it names (its bindings take
effect, an equivalent variant trains the same model), its rows' arithmetic, the
command line."""
import argparse
import json
import types

import gin
import pytest

import benchmark_modules

# The quickstart's run shrunk to a few seconds of compile: 4 layers, every 2nd one
# MoE (8 experts, top-2), d 32; vocab given so no vocabulary is built; one device
# of the tests' emulated eight, as a user's CPU run.
TINY = ["ModelConfig.d_model = 32", "ModelConfig.num_heads = 2",
        "ModelConfig.head_dim = 16", "ModelConfig.d_ff = 64",
        "ModelConfig.vocab_size = 256", "MoeConfig.group_size = 64",
        "train.num_devices = 1"]
BATCH, LENGTH = 2, 32
VARIANTS = [("einsum", ["MoeConfig.dispatcher = @EinsumDispatcher()"]),
            ("wide", ["ModelConfig.d_ff = 128"])]


@pytest.fixture(scope="module")
def bench():
  return benchmark_modules.load("train_step")


@pytest.fixture(scope="module")
def rows(bench):
  return bench.run(["runs/quickstart.gin"], TINY, [], VARIANTS, rounds=2, warmup=0,
                   batch_size=BATCH, length=LENGTH)


def test_one_row_per_path_base_first_and_gin_left_clear(rows):
  assert [r["path"] for r in rows] == ["base", "einsum", "wide"]
  assert [r["bindings"] for r in rows] == [TINY] + [TINY + b for _, b in VARIANTS]
  assert gin.config_str() == ""  # nothing of the runs' config leaks out


def test_variants_are_the_runs_they_name(rows):
  base, einsum, wide = rows
  # Another dispatcher of the same capacity routing: the same model and loss.
  assert einsum["first_loss"] == pytest.approx(base["first_loss"], rel=1e-5)
  assert einsum["model_flops_per_token"] == base["model_flops_per_token"]
  # A wider d_ff: OpenMoE's swiglu MLP has wi_0 [d, 2 f], wi_1 [d, f], wo [f, d], so
  # 4 x d x 64 more parameters per MLP pass, 6 FLOPs each; a token passes 8 MLPs:
  # 2 dense layers, 2 residual MLPs, 2 MoE layers x top-2 experts (expert_d_ff
  # unset: the experts are d_ff wide too).
  assert wide["model_flops_per_token"] - base["model_flops_per_token"] == (
      8 * 4 * 32 * 64 * 6)
  assert wide["first_loss"] != base["first_loss"]


def test_rows_arithmetic(rows):
  peak = max(rows[0]["peak_flops_start"], rows[0]["peak_flops_end"])
  assert peak > 0
  for row in rows:
    assert row["rounds"] == 2 and row["batch_size"] == BATCH
    assert 0 < row["step_ms_min"] <= row["step_ms"] <= row["step_ms_max"]
    assert row["tokens_per_s"] == pytest.approx(
        BATCH * LENGTH / (row["step_ms"] * 1e-3), rel=1e-3)
    assert row["mfu"] == pytest.approx(
        row["tokens_per_s"] * row["model_flops_per_token"] / peak, rel=2e-3)
    assert len(row["loadavg_start"]) == 3
  assert rows[0]["ratio_to_base"] is None
  for row in rows[1:]:
    assert 0 < row["ratio_to_base_min"] <= row["ratio_to_base"] <= row["ratio_to_base_max"]


def test_data_path_feeds_the_baseline_step_from_the_pipeline(bench, monkeypatch):
  """--data: the baseline's compiled step and state, one pipeline batch per call
  (the run's task at the run's shapes), timed in pairs like a variant."""
  from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  fed = []
  real_get_dataset = pipeline.get_dataset

  def get_dataset(task, length, batch_size, **kwargs):
    for batch in real_get_dataset(task, length, batch_size, **kwargs):
      fed.append((task, batch["decoder_target_tokens"].copy()))
      yield batch

  monkeypatch.setattr(pipeline, "get_dataset", get_dataset)
  no_vocab = [b for b in TINY if not b.startswith("ModelConfig.vocab_size")]
  base, data = bench.run(["runs/quickstart.gin"], no_vocab, [], [], rounds=2,
                         warmup=1, batch_size=BATCH, length=LENGTH, data=True)
  assert (base["path"], data["path"]) == ("base", "data")
  assert data["bindings"] == base["bindings"] == no_vocab
  # Its first step at build, then one batch per call: 1 warm-up and 2 timed pairs.
  assert len(fed) == 4 and {task for task, _ in fed} == {"local_mix"}
  assert all(tokens.shape == (BATCH, LENGTH) for _, tokens in fed)
  assert len({tokens.tobytes() for _, tokens in fed}) == 4  # a new batch each call
  assert data["model_flops_per_token"] == base["model_flops_per_token"]
  assert 0 < data["ratio_to_base_min"] <= data["ratio_to_base"] <= data["ratio_to_base_max"]
  assert data["first_loss"] != base["first_loss"]  # a real batch, a trained state
  assert gin.config_str() == ""


def test_data_path_needs_the_tasks_vocabulary(bench):
  with pytest.raises(bench.RunConfigError, match="vocabulary .256. is smaller"):
    bench.run(["runs/quickstart.gin"], TINY, [], [], rounds=1, warmup=0,
              batch_size=BATCH, length=LENGTH, data=True)
  assert gin.config_str() == ""


@pytest.mark.parametrize("text, expected", [
    ("scanned:ModelConfig.scan_layers=True", ("scanned", ["ModelConfig.scan_layers=True"])),
    ("a-1.b: X.y = 1 ; Z.w=@F()", ("a-1.b", ["X.y = 1", "Z.w=@F()"])),
])
def test_parse_variant(bench, text, expected):
  assert bench.parse_variant(text) == expected


@pytest.mark.parametrize("text", ["ModelConfig.scan_layers=True", "name:", "name:X.y",
                                  "na me:X.y=1", "n:X.y=1;;Z.w=2"])
def test_parse_variant_refuses(bench, text):
  with pytest.raises(argparse.ArgumentTypeError, match="NAME:BINDING"):
    bench.parse_variant(text)


def test_main_prints_json_rows_and_refuses_bad_flags(bench, capsys):
  flags = [f"--gin.{b.replace(' ', '')}" for b in TINY] + [
      f"--batch_size={BATCH}", f"--sequence_length={LENGTH}", "--rounds=1",
      "--warmup=0", "--json"]
  bench.main(flags)
  (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert row["path"] == "base" and row["ratio_to_base"] is None and row["rounds"] == 1
  for bad in (["--variant=base:X.y=1"], ["--data", "--variant=data:X.y=1"],
              ["--rounds=0"], ["--gin.NoSuch.param=1"]):
    with pytest.raises(SystemExit) as exit_info:
      bench.main(flags + bad)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_rows_of_known_times(bench):
  from openmoe_jax import partitioning  # pylint: disable=g-import-not-at-top

  def path(name, flops_per_token):
    return types.SimpleNamespace(
        name=name, bindings=[], batch_size=4, length=250, flops_per_token=flops_per_token,
        trainer=types.SimpleNamespace(mesh=partitioning.make_mesh(1)), first_loss=1.0,
        metrics={"loss": 2.0}, compile_s=3.0)

  paths = [path("base", 1e6), path("a", 2e6), path("b", 1e6)]
  times = {"a": ([10.0, 20.0, 30.0], [15.0, 20.0, 60.0]),  # ratios 1.5, 1, 2
           "b": ([40.0, 50.0, 60.0], [20.0, 40.0, 30.0])}  # ratios 0.5, 0.8, 0.5
  base, a, b = bench.rows_of(paths, times, 1e9, 2e9, [1, 1, 1], [2, 2, 2], rounds=3)
  assert (base["step_ms"], base["step_ms_min"], base["step_ms_max"]) == (35.0, 10.0, 60.0)
  assert (a["step_ms"], a["ratio_to_base"], a["ratio_to_base_min"],
          a["ratio_to_base_max"]) == (20.0, 1.5, 1.0, 2.0)
  assert (b["step_ms"], b["ratio_to_base"], b["ratio_to_base_min"]) == (30.0, 0.5, 0.5)
  assert base["tokens_per_s"] == pytest.approx(1000 / 0.035)
  # MFU against the faster of the two peaks (2e9): tokens/s x FLOPs per token / peak.
  assert a["mfu"] == pytest.approx(1000 / 0.020 * 2e6 / 2e9, rel=1e-5)
  assert base["ratio_to_base"] is None and base["loadavg_end"] == [2, 2, 2]
