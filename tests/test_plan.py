"""The TPU planner: ahead-of-time compiles of the sharded train step on this CPU
against libtpu's topology descriptions (installed by the test extra)."""
import json

import gin
import pytest

from openmoe_jax import gin_utils, plan

TINY = ["ModelConfig.vocab_size = 512", "ModelConfig.d_model = 128",
        "ModelConfig.num_heads = 2", "ModelConfig.head_dim = 64", "ModelConfig.d_ff = 256",
        "ModelConfig.num_layers = 2", "ModelConfig.sparse_interval = 2",
        "MoeConfig.num_experts = 8", "MoeConfig.group_size = 256"]


def _configure(*extra):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["models/quickstart_moe.gin"], TINY + list(extra), finalize=False)


@pytest.mark.parametrize("topology,chips,devices", [
    ("v3:2x2", 4, 8), ("v4:2x2x1", 4, 8), ("v5e:2x2", 4, 4), ("v5p:2x2x1", 4, 4),
    ("v6e:2x2", 4, 4)])
def test_expert_parallel_step_compiles_for_each_tpu_generation(topology, chips, devices):
  _configure("make_mesh.data = 1", "make_mesh.expert = -1")
  report = plan.plan(topology, batch_size=8, sequence_length=256, step_time_s=0.01)
  assert (report["num_chips"], report["num_devices"]) == (chips, devices)
  assert report["mesh"]["expert"] == devices
  assert report["fits"] and 0 < report["peak_bytes_per_device"] < 1 << 30
  assert report["argument_bytes"] > 0 and report["output_bytes"] > 0
  assert report["temp_bytes"] >= 0
  # The compiler's count includes the einsum dispatch and the unused capacity slots;
  # the analytic count is 6 x activated params x tokens + attention.
  assert 0.5 < report["compiled_flops"] / report["analytic_flops"] < 4
  assert 0 < report["mfu"] < 1
  # The default dispatcher picks the TPU expert-parallel path for capacity routing:
  # a fixed-capacity all_to_all of the expert buffers.
  assert report["collectives"]["all-to-all"] >= 2


def test_cli_json(capsys):
  args = ["--gin_file=models/quickstart_moe.gin", "--topology=v5e:2x2", "--json",
          "--gin.BATCH_SIZE=8", "--gin.SEQUENCE_LENGTH=256"]
  assert plan.main(args + [f"--gin.{b.replace(' ', '')}" for b in TINY]) == 0
  report = json.loads(capsys.readouterr().out)
  for key in ("topology", "num_chips", "hbm_bytes_per_chip", "argument_bytes",
              "temp_bytes", "output_bytes", "fits", "compiled_flops", "analytic_flops"):
    assert key in report
  assert report["batch_size"] == 8 and report["sequence_length"] == 256
  with pytest.raises(SystemExit, match="usage"):
    plan.main(["--gin_file=models/quickstart_moe.gin"])


def test_a_step_that_cannot_fit_is_reported_not_raised():
  _configure("ModelConfig.d_model = 4096", "ModelConfig.d_ff = 16384",
             "ModelConfig.num_layers = 8", "MoeConfig.num_experts = 64")
  report = plan.plan("v5e:2x2", batch_size=64, sequence_length=2048)
  assert report["fits"] is False and "HBM" in report["compiler_message"]
  assert "DOES NOT FIT" in plan.format_report(report)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_openmoe_base_preset_compiles_for_small_topologies(topology):
  # The real Base/16E preset (12 layers, 16 experts, 256,384-entry vocabulary); a
  # short batch keeps the compile under a minute (one MoE group of 2048 tokens).
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["models/openmoe_base_16e.gin"],
                      ["make_mesh.data = 1", "make_mesh.expert = -1"], finalize=False)
  report = plan.plan(topology, batch_size=8, sequence_length=256)
  assert report["mesh"]["expert"] == report["num_devices"]
  assert report["fits"] and report["argument_bytes"] > 1 << 30  # ~800M f32 params
  assert 0 < report["peak_bytes_per_device"] < report["hbm_bytes_per_device"]
  assert report["collectives"]["all-to-all"] >= 2
  print(f"{topology}: peak {report['peak_bytes_per_device'] / 2**30:.2f} GiB per device")
