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
