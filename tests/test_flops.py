"""flops.py: FLOPs per token counted by hand, against XLA's count, MFU arithmetic,
the calibration matmul, and train/mfu in a short training run."""
import json
import math
import os
import types

import jax
import jax.numpy as jnp
import optax
import pytest

from openmoe_jax import flops, gin_utils, partitioning, plan
from openmoe_jax.config import ModelConfig, MoeConfig, build_model_config
from openmoe_jax.data import pipeline
from openmoe_jax.model import Decoder
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter
from openmoe_jax.trainer import train

# d_model 32, 2 heads of 16 (inner 32), vocabulary 128, sequences of 64 tokens.
D, H, Q, V, T = 32, 2, 16, 128, 64
ATTENTION_PROJECTIONS = 4 * D * H * Q  # query, key, value [d, h, q]; out [h, q, d]
HEAD = D * V  # the untied output head; the embedding lookup is no matmul
# Scores q.k and the values p.v: T x H x Q multiply-adds each per token and layer;
# 2 FLOPs per multiply-add, x3 for training (not halved for the causal mask).
ATTENTION_SCORES_TRAIN = 3 * 2 * (2 * T * H * Q)


def _config(**changes):
  base = dict(vocab_size=V, d_model=D, num_heads=H, head_dim=Q, num_layers=1,
              d_ff=64, mlp_kind="swiglu", sparse_interval=0)
  return ModelConfig(**{**base, **changes})


def test_dense_layer_counted_by_hand():
  swiglu_mlp = D * 64 + D * 64 + 64 * D  # wi_0 [32, 64], wi_1 [32, 64], wo [64, 32]
  matmul_params = ATTENTION_PROJECTIONS + swiglu_mlp + HEAD  # 4096 + 6144 + 4096
  expected = 6 * matmul_params + ATTENTION_SCORES_TRAIN
  assert expected == 110592
  counts = flops.model_flops_per_token(_config(), T)
  assert counts["total"] == expected
  assert counts["hardware_total"] == expected
  forward = flops.model_flops_per_token(_config(), T, train=False)
  assert forward["total"] == 2 * matmul_params + 2 * (2 * T * H * Q)


def test_capacity_moe_layer_counted_by_hand():
  moe = MoeConfig(num_experts=4, top_k=2, expert_d_ff=32, group_size=64,
                  capacity_factor_train=1.25, min_capacity=4, residual_mlp=True)
  cfg = _config(mlp_kind="openmoe_swiglu", layer_pattern="M", moe=moe)
  residual_mlp = D * 128 + D * 64 + 64 * D  # openmoe_swiglu: wi_0 is [d, 2 x d_ff]
  router = D * 4
  expert = D * 64 + D * 32 + 32 * D  # d_ff 32: wi_0 [32, 64], wi_1, wo
  # Capacity per expert: round(1.25 x 64 tokens / 4 experts) = 20 slots, so the
  # 4 x 20 buffer rows of a 64-token group are 1.25 expert passes per token.
  shared = ATTENTION_PROJECTIONS + residual_mlp + router + HEAD
  model = 6 * (shared + 2 * expert) + ATTENTION_SCORES_TRAIN
  hardware = 6 * (shared + 1.25 * expert) + ATTENTION_SCORES_TRAIN
  assert (model, hardware) == (172800, 154368)
  counts = flops.model_flops_per_token(cfg, T, batch_tokens=128)
  assert counts["total"] == model
  assert counts["hardware_total"] == hardware
  assert counts["experts"] == 6 * 2 * expert and counts["router"] == 6 * router


def test_two_moe_layers_and_a_batch_smaller_than_the_group_counted_by_hand():
  """Per-layer terms (router, experts, the shared expert) count each MoE layer (2
  here, not 1), and the group is the batch when the batch is smaller: 128 tokens
  give each expert round(1.1 x 128 / 4) = 35 slots, 4 x 35 / 128 = 35/32 passes
  per token (a 4096-token group would give 4 x 1126 / 4096)."""
  moe = MoeConfig(num_experts=4, top_k=2, expert_d_ff=32, group_size=4096,
                  capacity_factor_train=1.1, min_capacity=4, residual_mlp=False,
                  num_shared_experts=1, shared_expert_d_ff=16)
  cfg = _config(num_layers=3, layer_pattern="MDM", moe=moe)
  dense_mlp = 3 * D * 64  # swiglu, d_ff 64
  expert = 3 * D * 32
  shared_expert = 3 * D * 16  # always on, ungated: no router column
  shared = (3 * ATTENTION_PROJECTIONS + dense_mlp + 2 * D * 4 + 2 * shared_expert
            + HEAD)
  model = 6 * (shared + 2 * 2 * expert) + 3 * ATTENTION_SCORES_TRAIN
  hardware = 6 * (shared + 2 * (35 / 32) * expert) + 3 * ATTENTION_SCORES_TRAIN
  counts = flops.model_flops_per_token(cfg, T, batch_tokens=128)
  assert counts["total"] == model and counts["hardware_total"] == hardware
  assert counts["router"] == 6 * 2 * D * 4 and counts["mlp"] == 6 * dense_mlp
  assert counts["experts"] == 6 * 2 * 2 * expert
  assert counts["shared_experts"] == 6 * 2 * shared_expert


def test_dropless_moe_with_gated_shared_expert_counted_by_hand():
  moe = MoeConfig(num_experts=4, top_k=2, expert_d_ff=32, group_size=64,
                  residual_mlp=False, router=TokenChoiceRouter(dropless=True),
                  num_shared_experts=1, shared_expert_d_ff=16, shared_experts_gated=True)
  cfg = _config(layer_pattern="M", moe=moe)
  router = D * (4 + 1)  # routed experts' w [32, 4] and the gated shared one's [32, 1]
  expert = D * 32 + D * 32 + 32 * D  # swiglu, d_ff 32
  shared_expert = D * 16 + D * 16 + 16 * D
  expected = (6 * (ATTENTION_PROJECTIONS + router + 2 * expert + shared_expert + HEAD)
              + ATTENTION_SCORES_TRAIN)
  counts = flops.model_flops_per_token(cfg, T, batch_tokens=512)
  assert counts["total"] == expected == 120768
  assert counts["hardware_total"] == expected  # dropless: exactly top_k per token


def test_expert_choice_counts_its_capacity_per_expert():
  moe = MoeConfig(num_experts=4, top_k=2, expert_d_ff=32, group_size=128,
                  capacity_factor_train=1.25, residual_mlp=False,
                  router=ExpertChoiceRouter(level="sequence"))
  cfg = _config(layer_pattern="M", moe=moe)
  expert = 3 * D * 32
  # Each expert takes round(1.25 x 2 x 64 / 4) = 40 of a sequence's 64 tokens.
  passes = 4 * 40 / 64
  expected = (6 * (ATTENTION_PROJECTIONS + D * 4 + passes * expert + HEAD)
              + ATTENTION_SCORES_TRAIN)
  counts = flops.model_flops_per_token(cfg, T, batch_tokens=256)
  assert counts["total"] == counts["hardware_total"] == expected


def test_expert_choice_unit_is_the_sequence_or_the_group_by_level():
  """Capacity is rounded per routing unit (level "batch": the MoE group), so the
  unit shows: at capacity factor 1.1, k 2, E 4, a sequence of 64 tokens gives each
  expert round(35.2) = 35 slots (4 x 35 / 64 passes per token) and a group of three
  sequences round(105.6) = 106 (4 x 106 / 192)."""
  for level, passes in [("sequence", 4 * 35 / 64), ("batch", 4 * 106 / 192)]:
    moe = MoeConfig(num_experts=4, top_k=2, expert_d_ff=32, group_size=192,
                    capacity_factor_train=1.1, residual_mlp=False,
                    router=ExpertChoiceRouter(level=level))
    cfg = _config(layer_pattern="M", moe=moe)
    expected = (6 * (ATTENTION_PROJECTIONS + D * 4 + passes * 3 * D * 32 + HEAD)
                + ATTENTION_SCORES_TRAIN)
    counts = flops.model_flops_per_token(cfg, T, batch_tokens=192)
    assert counts["total"] == pytest.approx(expected, rel=1e-12), level


def test_full_remat_adds_one_forward_to_hardware_flops_only():
  counts = flops.model_flops_per_token(_config(remat_policy="full"), T)
  assert counts["hardware_total"] == counts["total"] * 8 / 6


def _compiled_flops(fn, *args) -> float:
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_counts_match_the_compiled_forward_and_gradient():
  # One layer (XLA counts a scanned loop body once) at sizes where matmuls dominate.
  # XLA counts 2 FLOPs per multiply-add, like the convention, plus the elementwise
  # work (RMSNorm, RoPE, softmax, SiLU: O(d + T h + f) per token against the
  # O(d^2 + T h q + d f) of the matmuls), about 1% here: the compiled count must lie
  # in [1, 1.05] x the analytic one. The gradient's two matmuls per forward one
  # (inputs and weights; the embedding's gradient needs the first layer's input
  # gradient) make training 3x the forward.
  cfg = ModelConfig(vocab_size=512, d_model=128, num_heads=2, head_dim=64, d_ff=512,
                    num_layers=1, mlp_kind="swiglu", sparse_interval=0)
  model, tokens = Decoder(cfg), jnp.zeros((2, 128), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), tokens)["params"]
  logits = lambda p, x: model.apply({"params": p}, x)[0]
  loss = lambda p, x: optax.softmax_cross_entropy_with_integer_labels(
      logits(p, x), x).mean()
  for fn, training in ((logits, False), (jax.value_and_grad(loss), True)):
    analytic = flops.model_flops_per_token(cfg, 128, train=training)["total"] * tokens.size
    ratio = _compiled_flops(fn, params, tokens) / analytic
    assert 1.0 <= ratio <= 1.05, (training, ratio)


def test_mfu_arithmetic():
  # 1000 tokens/s x 1e6 FLOPs/token = 1e9 FLOP/s used of 2 devices x 1e9 FLOP/s.
  assert flops.mfu(1000.0, 1e6, 1e9, 2) == 0.5
  meter = flops.MfuMeter(model_flops_per_token=3e6, hardware_flops_per_token=4e6,
                         peak_flops_per_sec=2e9, num_devices=4)
  assert meter.scalars(800.0) == {"train/mfu": 0.3,
                                  "train/model_flops_per_token": 3e6,
                                  "train/hardware_flops_per_token": 4e6}


def test_peak_calibration_times_many_reps(monkeypatch):
  calls = []

  def counting_jit(fn):
    def run(a, b):
      calls.append(1)
      return fn(a, b)
    return run

  monkeypatch.setattr(flops.jax, "jit", counting_jit)
  flops.measured_matmul_peak_flops(jnp.float32, size=64)
  assert len(calls) == 1 + 30  # warm-up, then 30 timed (well within the budget)
  calls.clear()
  flops.measured_matmul_peak_flops(jnp.float32, size=64, reps=4, budget_s=0.0)
  assert len(calls) == 1 + 2  # the budget is spent: stops after two timed reps
  calls.clear()
  flops.measured_matmul_peak_flops(jnp.float32, size=64, reps=4, budget_s=0.0,
                                   calls=5)
  assert len(calls) == 1 + 2 * 5  # each rep queues 5 matmuls


def test_peak_calibration_divides_a_rep_by_its_calls(monkeypatch):
  """A rep of `calls` back-to-back matmuls reads the clock around all of them; the
  peak is 2 size^3 FLOPs over the rep's time / calls."""
  ticks = iter([10.0, 10.0, 11.0, 11.0, 13.0])  # start, rep 1 (1 s), rep 2 (2 s)
  # flops' own clock only (jax's compile reads time.perf_counter too).
  monkeypatch.setattr(flops, "time", types.SimpleNamespace(
      perf_counter=lambda: next(ticks, 100.0)))
  peak = flops.measured_matmul_peak_flops(jnp.float32, size=64, reps=2, calls=4)
  assert peak == pytest.approx(2 * 64 ** 3 / (1.0 / 4))


def test_peak_calibration_stops_once_its_budget_is_spent(monkeypatch):
  """A fake clock that only the matmuls advance, 0.5 s each: after the warm-up,
  reps end 0.5, 1.0, 1.5 and 2.0 s into the timing; the default budget (1.5 s) is
  passed, not only reached, after the 4th. The operands sit on the device asked for."""
  clock, devices = [0.0], []

  def slow_jit(fn):
    def run(a, b):
      clock[0] += 0.5
      devices.append(a.devices() | b.devices())
      return fn(a, b)
    return run

  monkeypatch.setattr(flops.jax, "jit", slow_jit)
  monkeypatch.setattr(flops, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  device = jax.devices()[-1]
  assert device != jax.devices()[0]  # the tests emulate 8 CPU devices
  peak = flops.measured_matmul_peak_flops(jnp.float32, size=64, device=device)
  assert len(devices) == 1 + 4 and all(d == {device} for d in devices)
  assert peak == 2 * 64 ** 3 / 0.5


def test_a_calibrated_peak_keeps_its_highest_reading_and_a_given_one_stays():
  readings = [1e8, 3e8, 2e8, 3e8]  # equal, higher, lower, equal to the highest
  meter = flops.MfuMeter(1e6, 1e6, 1e8, 1, calibrate=lambda: readings.pop(0))
  assert [meter.recalibrate() for _ in range(4)] == [False, True, False, False]
  assert meter.peak_flops_per_sec == 3e8 and not readings
  given = flops.MfuMeter(1e6, 1e6, 1e8, 1)  # a peak from gin is not measured again
  assert not given.recalibrate() and given.peak_flops_per_sec == 1e8


def test_the_mfu_meter_prints_its_peak_and_flops_per_token(monkeypatch):
  """The capacity MoE counted by hand above (172800 model and 154368 hardware FLOPs
  a token), its peak given in gin, then measured (a fake calibration)."""
  moe = MoeConfig(num_experts=4, top_k=2, expert_d_ff=32, group_size=64,
                  capacity_factor_train=1.25, min_capacity=4, residual_mlp=True)
  cfg = _config(mlp_kind="openmoe_swiglu", layer_pattern="M", moe=moe)
  mesh = partitioning.make_mesh(2)
  lines = []
  meter = flops.mfu_meter(cfg, T, 128, mesh, 2e9, lines.append)
  flops_line = "model 0.17 MFLOP/token, hardware 0.15 MFLOP/token (training)"
  assert lines == ["MFU peak: 2.0 GFLOP/s per device x 1 (train.peak_flops_per_sec); "
                   + flops_line]
  assert (meter.model_flops_per_token, meter.hardware_flops_per_token) == (172800, 154368)
  assert (meter.peak_flops_per_sec, meter.num_devices, meter.calibrate) == (2e9, 1, None)
  monkeypatch.setattr(flops, "measured_matmul_peak_flops", lambda *a, **k: 5e9)
  lines.clear()
  meter = flops.mfu_meter(cfg, T, 128, mesh, None, lines.append)
  assert lines == ["MFU peak: 5.0 GFLOP/s per device x 1 (measured: fastest 1024x1024 "
                   "float32 matmul on cpu; measured again at each evaluation, the highest "
                   "kept); " + flops_line]
  assert meter.peak_flops_per_sec == 5e9 and meter.calibrate() == 5e9


def test_calibration_matmul_per_platform():
  """A GPU's calibration is 5 queued 8192-wide products a rep (a single 4096-wide
  one on an H200 times its launch too); the CPU's one 1024-wide product; the
  trainer's calibration and the benchmarks' peak use the same."""
  gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
  assert flops.calibration_matmul(gpu) == (8192, 5)
  assert flops.calibration_matmul(jax.devices()[0]) == (1024, 1)
  calibrate = flops.calibration(None, "bfloat16", gpu)
  assert calibrate.args == ("bfloat16", 8192)
  assert calibrate.keywords == {"device": gpu, "calls": 5}
  assert flops.calibration(3e14, "bfloat16", gpu) is None  # given in gin


def test_a_known_tpu_takes_its_spec_sheet_and_an_unknown_one_is_measured():
  v5e = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
  assert flops.calibration(None, "bfloat16", v5e) is None
  assert flops.resolve_peak_flops(None, "bfloat16", v5e) == (
      197e12, "the TPU v5 lite spec sheet")  # Cloud TPU v5e: 197 TFLOP/s bf16
  unknown = types.SimpleNamespace(platform="tpu", device_kind="TPU v99")
  calibrate = flops.calibration(None, "bfloat16", unknown)
  assert calibrate.func is flops.measured_matmul_peak_flops
  assert calibrate.keywords["device"] is unknown
  cpu = types.SimpleNamespace(platform="cpu", device_kind="TPU v4")  # kind ignored
  assert flops.calibration(None, "float32", cpu) is not None
  # Any positive peak given in gin is taken as it is.
  assert flops.resolve_peak_flops(0.5, "float32", v5e) == (0.5, "train.peak_flops_per_sec")


def test_peak_calibration_and_sources():
  measured = flops.measured_matmul_peak_flops(jnp.float32, size=256)
  assert math.isfinite(measured) and measured > 0
  assert flops.resolve_peak_flops(5e9, "float32") == (5e9, "train.peak_flops_per_sec")
  peak, source = flops.resolve_peak_flops(None, "float32")
  assert peak > 0 and source.startswith("measured")
  with pytest.raises(ValueError, match="peak_flops_per_sec"):
    flops.resolve_peak_flops(0.0, "float32")
  # The trainer cannot import the planner (it imports the trainer): same figures.
  assert flops.TPU_PEAK_FLOPS == {kind: peak for kind, (_, peak) in plan.CHIPS.items()}
  # Emulated CPU devices share the host's cores: one peak per process.
  assert flops.peak_devices(partitioning.make_mesh(8)) == 1


def test_training_logs_mfu_and_the_summary_has_it(tmp_path):
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/quickstart.gin"], [
      "ModelConfig.d_model = 32", "ModelConfig.num_heads = 2",
      "ModelConfig.head_dim = 16", "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 2",
      "MoeConfig.num_experts = 4", "MoeConfig.group_size = 64", "SEQUENCE_LENGTH = 64",
      "BATCH_SIZE = 8", "train.eval_batches = 1", "train.log_every_steps = 1",
      "TRAIN_STEPS = 2", "adamw_warmup_cosine.warmup_steps = 1",
      f"MODEL_DIR = '{tmp_path}'", "train.peak_flops_per_sec = 1e9"])
  vocab = pipeline.vocabulary_for("local_mix")
  cfg = build_model_config(ModelConfig(), vocab.vocab_size)  # as train() builds it
  lines = []
  summary = train(print_fn=lines.append)
  expected = flops.model_flops_per_token(cfg, 64, batch_tokens=512)
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if "train/loss" in line]
  assert len(rows) == 2
  for row in rows:
    assert row["train/model_flops_per_token"] == expected["total"]
    assert row["train/hardware_flops_per_token"] == expected["hardware_total"]
    assert row["train/mfu"] == pytest.approx(
        row["train/tokens_per_sec"] * expected["total"] / 1e9)
  assert summary["mfu"] == pytest.approx(summary["tokens_per_sec"] * expected["total"]
                                         / 1e9)
  assert any(l.startswith("MFU peak: 1.0 GFLOP/s per device x 1 "
                          "(train.peak_flops_per_sec)") for l in lines), lines


def test_peak_calibration_runs_inside_a_mesh_of_several_devices():
  from openmoe_jax import partitioning  # pylint: disable=g-import-not-at-top
  with partitioning.activate(partitioning.make_mesh(2)):
    assert flops.measured_matmul_peak_flops(jnp.float32, size=64, reps=2) > 0
