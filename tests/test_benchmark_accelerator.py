"""benchmarks/accelerator.py --tiny: runs on the CPU in a subprocess and writes one
JSON holding the device, the MoE layer table and the train step's tokens/s and MFU."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from openmoe_jax.model import Decoder

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "accelerator.py"


@pytest.mark.slow
def test_tiny_run_writes_one_json_with_every_section(tmp_path):
  out = tmp_path / "accelerator.json"
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one CPU device, as a user's run
  subprocess.run([sys.executable, str(SCRIPT), "--tiny", f"--output={out}"],
                 check=True, env=env, cwd=tmp_path, timeout=300)
  report = json.loads(out.read_text())
  assert report["tiny"] is True
  assert report["device"] == {"device_kind": "cpu", "backend": "cpu",
                              "device_count": 1,
                              "jax_version": report["device"]["jax_version"]}
  assert len(report["loadavg_start"]) == len(report["loadavg_end"]) == 3
  layer = report["moe_layer"]
  assert layer["dtype"] == "bfloat16" and layer["skipped_configs"] == []
  assert layer["peak_flops_start"] > 0 and layer["peak_flops_end"] > 0
  assert [(r["config"], r["dispatcher"]) for r in layer["rows"]] == [
      ("tiny_e8_k2", d) for d in ("einsum", "sort", "ragged_dot_dropless", "auto")]
  for row in layer["rows"]:
    assert row["dtype"] == "bfloat16" and row["rounds"] == 2
    assert row["ms"] > 0 and row["dense_ms"] > 0 and row["ratio_to_dense"] > 0
    assert 0 < row["peak_fraction"] and 0 < row["dense_peak_fraction"]
    assert row["flops_source"] == "analytic" and row["loadavg_end"] is not None
  train = report["train_step"]
  assert train["steps_timed"] == 3 and train["devices"] == 1
  assert train["batch_size"] * train["sequence_length"] == 64
  assert train["tokens_per_s"] == pytest.approx(64 / (train["step_ms"] * 1e-3), rel=1e-3)
  assert train["mfu_measured_peak"] == pytest.approx(
      train["tokens_per_s"] * train["model_flops_per_token"]
      / train["peak_flops_measured"], rel=1e-2)
  assert 0 < train["mfu_measured_peak"] < 1
  assert train["peak_flops_spec"] is None and train["mfu_spec_peak"] is None
  assert train["parameters"] > 0 and train["loss"] > 0
  # 64 tokens, E 4, top-2: the CPU's pick for a small one-hot tensor.
  assert train["dispatcher"].startswith("AutoDispatcher -> EinsumDispatcher(")
  assert train["attention"] == "default (AutoAttention)"
  assert layer["failed_configs"] == {} and layer["min_sample_ms"] == 0.0  # CPU
  by_dispatcher = report["train_step_by_dispatcher"]
  assert {k: v["dispatcher"].split("(")[0] for k, v in by_dispatcher.items()} == {
      "einsum": "EinsumDispatcher", "sort": "SortDispatcher",
      "block": "BlockDispatcher", "ragged_dot": "RaggedDispatcher"}
  for entry in by_dispatcher.values():
    assert entry["steps_timed"] == 3 and entry["tokens_per_s"] == pytest.approx(
        64 / (entry["step_ms"] * 1e-3), rel=1e-3)
    assert 0 < entry["mfu_measured_peak"] < 1


@pytest.fixture(name="accelerator")
def _accelerator():
  sys.path.insert(0, str(ROOT))
  from benchmarks import accelerator  # pylint: disable=g-import-not-at-top
  return accelerator


def test_a_failing_part_is_reported_and_the_rest_goes_on(accelerator, monkeypatch):
  """One GPU try per session: a config that fails to compile, a default attention
  the GPU refuses or a dispatcher that fails is written into the JSON beside the
  parts that ran, not lost with them."""
  monkeypatch.setattr(accelerator.timing, "matmul_peak", lambda dtype: 1e9)
  def time_shape(config, *args):
    if config == "bad":
      raise RuntimeError("no kernel for this shape")
    return [{"config": config, "dispatcher": "sort", "useful_flops": 1.0,
             "dense_useful_flops": 1.0, "ms": 1.0, "dense_ms": 1.0}]
  monkeypatch.setattr(accelerator.moe_layer, "time_shape", time_shape)
  section = accelerator.layer_section({"bad": (), "good": ()}, ("sort",), 1, 60.0, 20.0)
  assert [r["config"] for r in section["rows"]] == ["good"]
  assert section["failed_configs"] == {"bad": "RuntimeError: no kernel for this shape"}
  assert section["min_sample_ms"] == 20.0
  seen = []
  def train_section(cfg, *args):
    seen.append(cfg)
    if cfg.attention_impl is None:
      raise ValueError("cuDNN: unsupported mask")
    if cfg.moe.dispatcher == accelerator.TRAIN_DISPATCHERS["block"]:
      raise ValueError("out of memory")
    return {k: 1 for k in ("dispatcher", "step_ms", "step_ms_min", "step_ms_max",
                           "steps_timed", "tokens_per_s", "mfu_measured_peak",
                           "mfu_spec_peak", "compile_and_warmup_s")}
  monkeypatch.setattr(accelerator, "train_section", train_section)
  cfg = accelerator.MODEL_TINY
  result = accelerator.train_with_fallback(cfg, 2, 32, 3, 10.0)
  assert result["attention"] == "PlainAttention (fallback)"
  assert result["default_attention_error"] == "ValueError: cuDNN: unsupported mask"
  assert [type(c.attention_impl).__name__ for c in seen] == ["NoneType",
                                                             "PlainAttention"]
  seen.clear()
  plain = accelerator.dataclasses.replace(cfg,
                                         attention_impl=accelerator.PlainAttention())
  by_dispatcher = accelerator.train_by_dispatcher(plain, ["sort", "block"], 2, 32, 3, 10.0)
  assert by_dispatcher["block"] == {"error": "ValueError: out of memory"}
  assert by_dispatcher["sort"]["tokens_per_s"] == 1
  assert [c.moe.dispatcher for c in seen] == [
      accelerator.TRAIN_DISPATCHERS["sort"], accelerator.TRAIN_DISPATCHERS["block"]]


def test_trainer_and_the_benchmark_import_without_seqio_tensorflow_or_clu():
  """The GPU images people benchmark on rarely hold TensorFlow: the Trainer class
  (and this script) import without the data stack, which `train()` and a metrics
  logger import when they run."""
  code = ("import sys; sys.path.insert(0, sys.argv[1]); "
          "import openmoe_jax.trainer; from benchmarks import accelerator; "
          "print(sorted(m for m in ('seqio', 'tensorflow', 'clu') if m in sys.modules))")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code, str(ROOT)], check=True, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.stdout.strip() == "[]"


def test_model_1b_has_about_a_billion_parameters_and_gpu_peaks():
  sys.path.insert(0, str(ROOT))
  from benchmarks import accelerator  # pylint: disable=g-import-not-at-top
  from openmoe_jax import flops  # pylint: disable=g-import-not-at-top
  cfg = accelerator.MODEL_1B
  tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  shapes = jax.eval_shape(lambda t: Decoder(cfg).init(jax.random.PRNGKey(0), t), tokens)
  assert 1.0e9 < sum(x.size for x in jax.tree.leaves(shapes)) < 1.2e9  # 1.08B
  counts = flops.model_flops_per_token(cfg, 2048, batch_tokens=8 * 2048)
  # 0.34B activated matmul parameters, plus the attention scores.
  assert 6 * 0.3e9 < counts["total"] - counts["attention_scores"] < 6 * 0.4e9
  assert accelerator.spec_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert accelerator.spec_peak_flops("NVIDIA H100 PCIe") == 756e12
  assert accelerator.spec_peak_flops("NVIDIA H200") == 989e12
  assert accelerator.spec_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
  assert accelerator.spec_peak_flops("cpu") is None


def test_an_unknown_train_dispatcher_is_refused_before_anything_runs(
    accelerator, monkeypatch, capsys, tmp_path):
  monkeypatch.setattr(accelerator, "layer_section", lambda *a: 1 / 0)
  with pytest.raises(SystemExit):
    accelerator.main([f"--output={tmp_path / 'x.json'}", "--train_dispatchers=sort,fast"])
  assert "unknown ['fast']" in capsys.readouterr().err
  assert not (tmp_path / "x.json").exists()
