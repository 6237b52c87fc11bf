"""The TPU planner: ahead-of-time compiles of the sharded train step on this CPU
against libtpu's topology descriptions (installed by the test extra)."""
import json

import gin
import pytest

from openmoe_jax import gin_utils, plan
from openmoe_jax.cli import plan as plan_cli
from openmoe_jax.config import ModelConfig, MoeConfig

TINY = ["ModelConfig.vocab_size = 512", "ModelConfig.d_model = 128",
        "ModelConfig.num_heads = 2", "ModelConfig.head_dim = 64", "ModelConfig.d_ff = 256",
        "ModelConfig.num_layers = 2", "ModelConfig.sparse_interval = 2",
        "MoeConfig.num_experts = 8", "MoeConfig.group_size = 256"]


# TINY's shape, written out for the counts below.
B_SEQ, D, HEADS_X_DIM, F, V, E, K, GROUP = 256, 128, 128, 256, 512, 8, 2, 256
CAPACITY = max(round(1.25 * GROUP / E), 4)  # quickstart_moe.gin: cf 1.25, min 4
# Peak dense bf16 FLOP/s per chip (public spec sheets).
PEAK = {"v3": 123e12, "v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}


def _tiny_activated_matmul_params() -> int:
  """Returns TINY's activated parameters less the embedding table, by hand: head,
  final norm, a dense layer (2 norms, attention, OpenMoE SwiGLU MLP) and an MoE layer
  (3 norms, attention, router, top-2 of the 8 experts, residual MLP)."""
  attention = 4 * D * HEADS_X_DIM
  mlp = D * 2 * F + D * F + F * D
  dense = 2 * D + attention + mlp
  sparse = 3 * D + attention + D * E + K * mlp + mlp
  return D * V + D + dense + sparse


def _tiny_analytic_flops(batch: int) -> int:
  """Returns the planner's documented estimate for TINY on `batch` sequences:
  tokens x (6 x activated matmul params + 12 L T h d_h)."""
  return batch * B_SEQ * (6 * _tiny_activated_matmul_params()
                          + 12 * 2 * B_SEQ * HEADS_X_DIM)


def _tiny_train_step_dot_flops(batch: int) -> int:
  """Returns the matmul FLOPs (2 per multiply-add) of TINY's train step on
  `batch` sequences: 3x the forward (each dot's backward takes the gradients of both
  operands: activations, and weights or the other activation). Forward, n tokens:
  per layer q, k, v, out projections and the two [T, T] attention products; the
  dense MLP per layer; in the MoE layer the router and the 8 experts on their
  capacity buffers (E x C rows per group of 256 tokens, however full; the sort
  dispatcher gathers rows, no dots); the head."""
  n = batch * B_SEQ
  attention = 2 * n * D * HEADS_X_DIM * 4 + 2 * 2 * batch * B_SEQ * B_SEQ * HEADS_X_DIM
  mlp = lambda rows: 2 * rows * (D * 2 * F + D * F + F * D)
  expert_rows = E * CAPACITY * (n // GROUP)
  forward = (2 * attention + 2 * mlp(n) + 2 * n * D * E + mlp(expert_rows)
             + 2 * n * D * V)
  return 3 * forward


def _configure(*extra):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["models/quickstart_moe.gin"], TINY + list(extra), finalize=False)


@pytest.mark.parametrize("topology,chips,devices", [
    ("v3:2x2", 4, 8), ("v4:2x2x1", 4, 8), ("v5e:2x2", 4, 4), ("v5p:2x2x1", 4, 4),
    ("v6e:2x2", 4, 4)])
def test_expert_parallel_step_compiles_for_each_tpu_generation(topology, chips, devices):
  # Plain attention: the count below has its [T, T] dots, which XLA cannot see
  # inside the default's splash attention kernel on TPU (a Mosaic custom call).
  _configure("make_mesh.data = 1", "make_mesh.expert = -1",
             "ModelConfig.attention_impl = @PlainAttention()")
  report = plan.plan(topology, batch_size=8, sequence_length=256, step_time_s=0.01)
  assert (report["num_chips"], report["num_devices"]) == (chips, devices)
  assert report["mesh"]["expert"] == devices
  assert report["fits"] and 0 < report["peak_bytes_per_device"] < 1 << 30
  assert report["argument_bytes"] > 0 and report["output_bytes"] > 0
  assert report["temp_bytes"] >= 0
  # The step donates its state, so its outputs reuse the arguments' buffers: the
  # aliased bytes are counted once.
  assert report["alias_bytes"] > 0
  assert report["peak_bytes_per_device"] == (
      report["argument_bytes"] + report["temp_bytes"] + report["output_bytes"]
      - report["alias_bytes"])
  assert report["analytic_flops"] == _tiny_analytic_flops(8)
  # The compiler's count: XLA counts 2 FLOPs per multiply-add of every dot, plus
  # about one per element of each elementwise op and reduction (softmaxes, norms,
  # gates, the optimizer's per-parameter update). The dots are all there (>= 1).
  # Each element of the large activations (scores, hidden units, logits) comes from
  # a dot of depth >= 64, i.e. >= 384 dot FLOPs forward and backward, so ~10-20
  # elementwise ops per element add a few percent: measured 1.034-1.036 on all five
  # generations (jax 0.10, libtpu of the test extra); 1.05 leaves room for compiler
  # changes but not for a wrong capacity (1.25 with cf x k slots) or the one-hot
  # einsum dispatch in place of the sort buffers (1.13).
  ratio = report["compiled_flops"] / _tiny_train_step_dot_flops(8)
  assert 1.0 <= ratio < 1.05, ratio
  peak = PEAK[topology.split(":")[0]]
  assert report["mfu"] == pytest.approx(_tiny_analytic_flops(8) / (0.01 * chips * peak))
  # The default dispatcher picks the TPU expert-parallel path for capacity routing:
  # a fixed-capacity all_to_all of the expert buffers.
  assert report["collectives"]["all-to-all"] >= 2


def test_cli_json(capsys):
  args = ["--gin_file=models/quickstart_moe.gin", "--topology=v5e:2x2", "--json",
          "--gin.BATCH_SIZE=8", "--gin.SEQUENCE_LENGTH=256"]
  assert plan_cli.main(args + [f"--gin.{b.replace(' ', '')}" for b in TINY]) == 0
  report = json.loads(capsys.readouterr().out)
  for key in ("topology", "num_chips", "hbm_bytes_per_chip", "argument_bytes",
              "temp_bytes", "output_bytes", "fits", "compiled_flops", "analytic_flops"):
    assert key in report
  assert report["batch_size"] == 8 and report["sequence_length"] == 256
  assert (report["topology"], report["num_chips"]) == ("v5e:2x2", 4)
  assert report["hbm_bytes_per_chip"] == 16 * 1024 ** 3  # v5e: 16 GiB HBM per chip
  assert report["analytic_flops"] == _tiny_analytic_flops(8)
  assert plan_cli.main(["--gin_file=models/quickstart_moe.gin"]) == 2  # no --topology


def test_a_step_that_cannot_fit_is_reported_not_raised():
  _configure("ModelConfig.d_model = 4096", "ModelConfig.d_ff = 16384",
             "ModelConfig.num_layers = 8", "MoeConfig.num_experts = 64")
  report = plan.plan("v5e:2x2", batch_size=64, sequence_length=2048)
  assert report["fits"] is False and "HBM" in report["compiler_message"]
  assert "DOES NOT FIT" in plan.format_report(report)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v4:2x2x1", "v5e:2x2"])
def test_openmoe_base_preset_compiles_for_small_topologies(topology):
  # The real Base/16E preset (12 layers, 16 experts, 256,384-entry vocabulary); a
  # short batch keeps the compile short (one MoE group of 2048 tokens).
  # Two of the five generations (2 to 3 minutes of compile each on a slow 2-core
  # host): v4's 8 devices (two TensorCores per chip: 2 experts per device) and
  # v5e's 4 (4 experts per device, the smallest HBM). The tiny-model test above
  # compiles the same program structure for all five.
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


@pytest.mark.parametrize("fits, code", [(True, 0), (False, plan_cli.EXIT_DOES_NOT_FIT)])
def test_exit_code_says_whether_the_step_fits(monkeypatch, capsys, fits, code):
  report = {"topology": "v5e:2x2", "mesh": {"data": 4}, "batch_size": 8,
            "sequence_length": 256, "fits": fits, "compiler_message": "over HBM"}
  monkeypatch.setattr(plan_cli, "plan", lambda *a, **k: report)
  assert plan_cli.main(["--gin_file=models/quickstart_moe.gin", "--topology=v5e:2x2",
                    "--json"]) == code
  assert json.loads(capsys.readouterr().out)["fits"] is fits
  assert plan_cli.EXIT_DOES_NOT_FIT not in (0, 1, 2)  # apart from success and errors


def test_roofline_arithmetic():
  # 2e12 FLOPs at 1e14 FLOP/s: 20 ms; 1e10 bytes at 1e12 B/s: 10 ms -> compute-bound.
  estimate = plan.roofline(2e12, 1e10, 1e14, 1e12)
  assert estimate == {"step_s": pytest.approx(0.02), "compute_s": pytest.approx(0.02),
                      "memory_s": pytest.approx(0.01), "bound": "compute"}
  assert plan.roofline(1e12, 1e11, 1e14, 1e12)["bound"] == "HBM"
  assert plan.roofline(1e12, 1e10, 1e14, 1e12)["bound"] == "compute"  # a tie: 10 ms each


def test_the_estimate_uses_the_loop_corrected_compiled_flops():
  # TINY's two layers are one scanned unit seen once, so only the 2 microbatches are
  # under-counted: XLA's FLOPs x 2 on 4 v5e chips at their spec-sheet peak.
  _configure()
  report = plan.plan("v5e:2x2", batch_size=8, sequence_length=256, microbatches=2)
  assert report["loop_correction"] == pytest.approx(2.0)
  assert report["estimated_compute_s"] == pytest.approx(
      report["compiled_flops"] * 2 / (4 * PEAK["v5e"]), rel=1e-9)
  assert report["estimated_step_s"] == pytest.approx(
      max(report["estimated_compute_s"], report["estimated_memory_s"]), rel=1e-12)


def test_loop_undercount_by_hand():
  # Four dense layers scanned one at a time: XLA sees one layer of four (plus the
  # head, outside the scan) and one of the two microbatches.
  d, inner, f, v, t = 64, 128, 256, 1000, 32
  cfg = ModelConfig(vocab_size=v, d_model=d, num_heads=2, head_dim=64, d_ff=f,
                    num_layers=4, mlp_kind="swiglu", layer_pattern="DDDD")
  layer = 6 * 4 * d * inner + 12 * t * inner + 6 * 3 * d * f
  head = 6 * d * v
  assert plan.loop_undercount(cfg, t, 2) == pytest.approx(
      2 * (4 * layer + head) / (layer + head))
  assert plan.loop_undercount(cfg.replace(scan_layers=False), t, 3) == pytest.approx(3)
  # One dense layer, then three MoE layers scanned as one: XLA sees one of each.
  mixed = cfg.replace(layer_pattern="DMMM", moe=MoeConfig(num_experts=4))
  dense, moe = plan._layer_flops(mixed, t)  # pylint: disable=protected-access
  assert moe > 1.5 * dense
  assert plan.loop_undercount(mixed, t, 1) == pytest.approx(
      (dense + 3 * moe + head) / (dense + moe + head))


@pytest.mark.slow
def test_the_loop_correction_recovers_the_unrolled_count():
  # Four layers scanned as two units of two, in two microbatches, against the same
  # step unrolled in one batch: uncorrected, XLA sees about a quarter of the work;
  # corrected, the counts agree to about 10% (measured: 1.089; the loop version
  # carries extra elementwise work, e.g. the gradient accumulation over microbatches).
  kw = dict(batch_size=8, sequence_length=256)
  _configure("ModelConfig.num_layers = 4", "ModelConfig.attention_impl = @PlainAttention()")
  looped = plan.plan("v5e:2x2", microbatches=2, **kw)
  _configure("ModelConfig.num_layers = 4", "ModelConfig.attention_impl = @PlainAttention()",
             "ModelConfig.scan_layers = False")
  unrolled = plan.plan("v5e:2x2", microbatches=1, **kw)
  assert unrolled["loop_correction"] == 1.0 and looped["loop_correction"] > 3
  assert looped["compiled_flops"] < 0.35 * unrolled["compiled_flops"]
  corrected = looped["compiled_flops"] * looped["loop_correction"]
  assert corrected == pytest.approx(unrolled["compiled_flops"], rel=0.12)
  # XLA's byte count of a loop body includes whole stacked buffers (measured here:
  # 6x the unrolled count once corrected), so the HBM term of a scanned model is an
  # upper bound and its estimate the slower one.
  assert looped["estimated_step_s"] >= unrolled["estimated_step_s"] > 0
  for report in (looped, unrolled):
    assert 0 < report["estimated_mfu"] < 1
    assert "roofline ESTIMATE" in plan.format_report(report)


def test_an_moe_layer_without_the_residual_mlp_weighs_one_dense_mlp_less():
  """The loop correction weighs each layer by its training FLOPs per token: an MoE
  layer without OpenMoE's extra dense MLP (residual_mlp=False) weighs 6 x the MLP's
  matmul parameters (SwiGLU: 3 d f) less; dense layers are unchanged."""
  d, f, t = 64, 256, 32
  cfg = ModelConfig(vocab_size=1000, d_model=d, num_heads=2, head_dim=64, d_ff=f,
                    num_layers=2, mlp_kind="swiglu", layer_pattern="DM",
                    moe=MoeConfig(num_experts=4, residual_mlp=True))
  dense, moe = plan._layer_flops(cfg, t)  # pylint: disable=protected-access
  no_residual = cfg.replace(moe=cfg.moe.replace(residual_mlp=False))
  dense_2, moe_2 = plan._layer_flops(no_residual, t)  # pylint: disable=protected-access
  assert dense_2 == dense
  assert moe - moe_2 == pytest.approx(6 * 3 * d * f)
  # Twice the layers, twice the MoE layers: each still weighs the same.
  twice = plan._layer_flops(cfg.replace(num_layers=4, layer_pattern="DMDM"), t)  # pylint: disable=protected-access
  assert twice == pytest.approx((dense, moe))


def test_gated_shared_experts_weigh_their_mlps_and_their_router_rows():
  """Two gated shared SwiGLU experts of width 96 add 6 x (2 x 3 d 96) FLOPs per token
  for their MLPs and 6 x 2 d for their two router rows to each MoE layer."""
  d, t = 64, 32
  cfg = ModelConfig(vocab_size=1000, d_model=d, num_heads=2, head_dim=64, d_ff=256,
                    num_layers=2, mlp_kind="swiglu", layer_pattern="DM",
                    moe=MoeConfig(num_experts=4))
  dense, moe = plan._layer_flops(cfg, t)  # pylint: disable=protected-access
  shared = cfg.replace(moe=cfg.moe.replace(
      num_shared_experts=2, shared_expert_d_ff=96, shared_experts_gated=True))
  dense_2, moe_2 = plan._layer_flops(shared, t)  # pylint: disable=protected-access
  assert dense_2 == dense
  assert moe_2 - moe == pytest.approx(6 * (2 * 3 * d * 96 + 2 * d))



def test_the_text_report_of_a_step_that_fits():
  """Every line of the readable report, from a report made by hand (GiB = 2^30)."""
  gib = 2 ** 30
  report = {"topology": "v5e:2x2", "device_kind": "TPU v5 lite", "num_chips": 4,
            "num_devices": 4, "mesh": {"data": 4}, "dispatcher": "einsum",
            "attention": "splash", "batch_size": 8, "sequence_length": 256,
            "argument_bytes": 1 * gib, "temp_bytes": 2 * gib, "output_bytes": gib // 2,
            "alias_bytes": gib // 4, "peak_bytes_per_device": 3.25 * gib,
            "hbm_bytes_per_device": 16 * gib, "fits": True, "compiled_flops": 1.5e12,
            "analytic_flops": 3e12, "collectives": {"all-reduce": 3, "all-to-all": 0},
            "loop_correction": 2.0, "estimated_step_s": 0.02, "estimated_compute_s": 0.02,
            "estimated_memory_s": 0.01, "estimated_bound": "compute",
            "estimated_mfu": 0.38, "mfu": 0.25}
  lines = plan.format_report(report).splitlines()
  assert lines[:5] == [
      "v5e:2x2 (TPU v5 lite): 4 chips, 4 devices, mesh {'data': 4}, MoE dispatch "
      "einsum, attention splash",
      "batch 8 x 256 tokens",
      "per device: arguments 1.00 GiB, temp 2.00 GiB, outputs 0.50 GiB (aliased 0.25 "
      "GiB) -> peak 3.25 GiB of 16.00 GiB HBM: fits",
      "FLOPs per step: compiled 1.500e+12 (XLA counts each loop body once: scanned "
      "layers and microbatches), analytic 3.000e+12",
      "collectives in the step: all-reduce 3"]
  assert lines[5].startswith("roofline ESTIMATE (not a measurement; XLA's per-device "
                             "FLOPs and bytes x 2.00 for the loops it counts once): "
                             "step 20.0 ms (compute 20.0 ms, HBM 10.0 ms: compute-bound)"
                             ", implying MFU 38.0%")
  assert lines[6:] == ["MFU at the given step time: 25.0%"]
  del report["mfu"]  # no --step_time: no such line
  assert len(plan.format_report(report).splitlines()) == 6


def test_cli_reads_batch_and_length_from_the_macros_or_their_documented_defaults(
    monkeypatch, capsys):
  seen = []
  monkeypatch.setattr(plan_cli, "plan", lambda topology, **kwargs: seen.append(
      (topology, kwargs)) or {"fits": True})
  monkeypatch.setattr(plan_cli, "format_report", lambda report: "text report")
  base = ["--gin_file=models/quickstart_moe.gin", "--topology=v5e:2x2"]
  assert plan_cli.main(base) == 0
  assert seen.pop() == ("v5e:2x2", {"batch_size": 8, "sequence_length": 2048,
                                    "step_time_s": None})
  assert capsys.readouterr().out == "text report\n"
  assert plan_cli.main(base + ["--gin.BATCH_SIZE=32", "--gin.SEQUENCE_LENGTH=512",
                               "--step_time=0.25"]) == 0
  assert seen.pop() == ("v5e:2x2", {"batch_size": 32, "sequence_length": 512,
                                    "step_time_s": 0.25})
  assert plan_cli.main(["--topology=v5e:2x2"]) == 2
  assert "--gin_file is required" in capsys.readouterr().err
