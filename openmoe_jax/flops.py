"""Model FLOPs per token, the peak FLOP/s to divide by, and MFU.

Convention (PaLM, Chowdhery et al. 2022, appendix B), used everywhere here: a
training token costs 6 FLOPs per matmul parameter it goes through (2 forward, 4
backward; one multiply-add = 2 FLOPs, as XLA counts) plus 12 x L x T x H x Q for the
attention scores and values (L layers, sequence length T, H heads of Q dims), NOT
halved for the causal mask: the compiled program multiplies the full T x T score
matrix and masks it. Evaluation (forward only) costs 2 and 4 instead of 6 and 12.

Only parameters that go through a matmul count: the embedding lookup does not, the
output head (untied, `Decoder`'s `head`) does; RMSNorm scales and the elementwise
gating are not counted. MoE layers count their router (d x E, plus d x S for jointly
gated shared experts), their shared experts and their residual dense MLP, and routed
experts two ways:

- model FLOPs (the MFU numerator, the usual definition): the useful work, top_k
  experts per token for token choice (dropless or not), and E x C / T expert passes
  per token for expert choice (every slot holds a real token);
- hardware FLOPs: what a capacity-buffer dispatcher multiplies, E x C slots per
  group of s tokens (padding included, dropped choices excluded), C from the
  router's own `capacity`; dropless token choice counts top_k (a grouped matmul
  multiplies the served rows only). `remat_policy="full"` recomputes the forward
  once more in training (+2 per parameter, +4 for attention).

MFU = tokens/s x model FLOPs per token / (peak FLOP/s per device x devices).
"""
import dataclasses
import functools
import time
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from openmoe_jax.config import ModelConfig
from openmoe_jax.layers.mlp import wi_0_width
from openmoe_jax.moe.layer import router_of
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter

# Peak dense bf16 FLOP/s per chip by `device_kind`: the same figures as plan.CHIPS
# (the planner imports the trainer, so the trainer cannot import it; a test keeps the
# two tables equal).
TPU_PEAK_FLOPS = {
    "TPU v3": 123e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
}


def mlp_matmul_params(kind: str, d_model: int, d_ff: int) -> int:
  """Returns the matmul parameters of one gated MLP (wi_0, wi_1, wo)."""
  return d_model * (wi_0_width(kind, d_ff) + d_ff) + d_ff * d_model


def expert_passes_per_token(cfg: ModelConfig, sequence_length: int,
                            tokens_per_group: int, train: bool) -> Tuple[float, float]:
  """Returns (model, hardware) routed-expert MLP passes per token of one MoE layer.

  `tokens_per_group` s is the MoE group actually formed (min(group_size, tokens of
  a batch)). Token choice: (top_k, E x C / s), or (top_k, top_k) when dropless;
  expert choice: both E x C / T, T the tokens of a routing unit (the group, or one
  sequence for level="sequence"). C comes from the router's `capacity`.
  """
  moe = cfg.moe
  router = router_of(moe)
  expert_choice = isinstance(router, ExpertChoiceRouter)
  unit = sequence_length if expert_choice and router.level == "sequence" else (
      tokens_per_group)
  capacity = router.capacity(unit, num_experts=moe.num_experts, top_k=moe.top_k,
                             capacity_factor=moe.capacity_factor(train),
                             min_capacity=moe.min_capacity)
  buffers = moe.num_experts * capacity / unit
  if expert_choice:
    return buffers, buffers
  if getattr(router, "dropless", False):
    return float(moe.top_k), float(moe.top_k)
  return float(moe.top_k), buffers


def model_flops_per_token(cfg: ModelConfig, sequence_length: int, *, train: bool = True,
                          batch_tokens: Optional[int] = None) -> Dict[str, float]:
  """Returns the FLOPs one token costs (module docstring's convention), itemised.

  Keys: attention_projections, attention_scores, mlp (dense layers and residual
  MLPs), router, experts (model), shared_experts, head, `total` (the sum: model
  FLOPs, MFU's numerator), experts_hardware and `hardware_total` (capacity buffers;
  remat recompute). `train`: forward + backward (6 per parameter) with the training
  capacity factor, else forward only (2) with the eval one. `batch_tokens`: tokens
  of one (micro)batch, which caps the MoE group (None: a full group_size group).
  """
  if cfg.vocab_size is None:
    raise ValueError("model_flops_per_token needs ModelConfig.vocab_size")
  per_param = 6 if train else 2
  d, kind = cfg.d_model, cfg.mlp_kind
  sparse = cfg.sparse_layers()
  num_moe = sum(sparse)
  num_mlp = len(sparse) - num_moe + (num_moe if cfg.moe.residual_mlp else 0)
  inner = cfg.num_heads * cfg.head_dim
  counts = {
      "attention_projections": per_param * cfg.num_layers * 4 * d * inner,
      "attention_scores": 2 * per_param * cfg.num_layers * sequence_length * inner,
      "mlp": per_param * num_mlp * mlp_matmul_params(kind, d, cfg.d_ff),
      "router": 0, "experts": 0, "shared_experts": 0, "experts_hardware": 0,
      "head": per_param * d * cfg.vocab_size,
  }
  if num_moe:
    moe = cfg.moe
    group = min(moe.group_size, batch_tokens or moe.group_size)
    useful, buffered = expert_passes_per_token(cfg, sequence_length, group, train)
    expert = per_param * num_moe * mlp_matmul_params(kind, d, cfg.expert_d_ff)
    gated_shared = moe.num_shared_experts if moe.shared_experts_gated else 0
    shared_ff = moe.shared_expert_d_ff or cfg.expert_d_ff
    counts["router"] = per_param * num_moe * d * (moe.num_experts + gated_shared)
    counts["experts"] = useful * expert
    counts["experts_hardware"] = buffered * expert
    counts["shared_experts"] = (per_param * num_moe * moe.num_shared_experts
                                * mlp_matmul_params(kind, d, shared_ff))
  counts = {k: float(v) for k, v in counts.items()}
  counts["total"] = sum(v for k, v in counts.items() if k != "experts_hardware")
  hardware = counts["total"] - counts["experts"] + counts["experts_hardware"]
  if train and cfg.remat_policy == "full":
    hardware *= (per_param + 2) / per_param  # one more forward pass
  counts["hardware_total"] = hardware
  return counts


def measured_matmul_peak_flops(dtype: Any = jnp.float32, size: int = 1024,
                               reps: int = 30, budget_s: float = 1.5,
                               device: Optional[jax.Device] = None,
                               calls: int = 1) -> float:
  """Returns the FLOP/s of the fastest of `reps` jitted [size, size] matmuls in
  `dtype` on `device` (default: the default device), 2 x size^3 FLOPs each; stops
  early once `budget_s` seconds of timing have passed (after two reps). Each rep
  times `calls` matmuls queued back to back and waits for the last (an accelerator's
  launch cost, otherwise timed with each product, is hidden behind the others). Runs
  outside any current mesh (`partitioning.activate`), whose jit would refuse a
  one-device matmul.

  30 reps (0.2 s on a 2-core CPU at 1024) rather than a handful: on a shared 2-core
  Intel Xeon, 8 fresh processes measured 268-343 GFLOP/s with 5 reps and 316-358
  with 40, and a low peak inflates the MFU divided by it (a quickstart run logged
  MFU 0.73 against 240 GFLOP/s, the next one 0.54 against 324 at the same
  tokens/s)."""
  device = device or jax.devices()[0]
  rng = np.random.default_rng(0)
  with jax.set_mesh(None):
    a, b = (jax.device_put(jnp.asarray(rng.standard_normal((size, size)), dtype),
                           device) for _ in range(2))
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))  # compile and warm up
    best, start = float("inf"), time.perf_counter()
    for i in range(reps):
      t0 = time.perf_counter()
      for _ in range(calls - 1):
        matmul(a, b)
      jax.block_until_ready(matmul(a, b))
      best = min(best, (time.perf_counter() - t0) / calls)
      if i >= 1 and time.perf_counter() - start > budget_s:
        break
  return 2.0 * size ** 3 / best


def calibration_matmul(device: jax.Device) -> Tuple[int, int]:
  """Returns (width, back-to-back calls per timed rep) of the calibration matmul on
  `device`: (1024, 1) on CPU; elsewhere (8192, 5), since a 4096-wide bf16 product
  lasts ~0.2 ms on an H200, not much more than launching it and waiting for it
  (measured there: 749-793 TFLOP/s this way)."""
  return (1024, 1) if device.platform == "cpu" else (8192, 5)


def calibration(peak_flops_per_sec: Optional[float], dtype: Any,
                device: jax.Device) -> Optional[Callable[[], float]]:
  """Returns the calibration that measures `device`'s peak (the fastest matmul in
  `dtype`), or None when the peak does not come from one: given in gin, or a
  known TPU's spec sheet."""
  if peak_flops_per_sec is not None or (device.platform == "tpu"
                                        and device.device_kind in TPU_PEAK_FLOPS):
    return None
  size, calls = calibration_matmul(device)
  return functools.partial(measured_matmul_peak_flops, dtype, size, device=device,
                           calls=calls)


def resolve_peak_flops(peak_flops_per_sec: Optional[float], dtype: Any,
                       device: Optional[jax.Device] = None) -> Tuple[float, str]:
  """Returns (peak FLOP/s of one device, where it came from): the gin value when
  given, else the spec sheet for a known TPU kind, else a calibration matmul in
  `dtype` on `device` (`calibration_matmul`)."""
  if peak_flops_per_sec is not None:
    if not peak_flops_per_sec > 0:
      raise ValueError(f"train.peak_flops_per_sec={peak_flops_per_sec} must be > 0 "
                       "(or None: measure it)")
    return float(peak_flops_per_sec), "train.peak_flops_per_sec"
  device = device or jax.devices()[0]
  calibrate = calibration(None, dtype, device)
  if calibrate is None:
    return TPU_PEAK_FLOPS[device.device_kind], f"the {device.device_kind} spec sheet"
  size, _ = calibration_matmul(device)
  return calibrate(), (f"measured: fastest {size}x{size} {jnp.dtype(dtype).name} "
                       f"matmul on {device.device_kind}")


def peak_devices(mesh: jax.sharding.Mesh) -> int:
  """Returns how many peaks the run's throughput is divided by: the mesh's devices,
  except on CPU, where a host's devices share its cores (one per process)."""
  if mesh.devices.flat[0].platform == "cpu":
    return jax.process_count()
  return mesh.devices.size


def mfu(tokens_per_sec: float, flops_per_token: float, peak_flops_per_sec: float,
        num_devices: int) -> float:
  """Returns the fraction of peak used: tokens/s x FLOPs/token / (peak x devices)."""
  return tokens_per_sec * flops_per_token / (peak_flops_per_sec * num_devices)


@dataclasses.dataclass
class MfuMeter:
  """A run's FLOPs per token and peak; turns a throughput into logged scalars.

  `calibrate` (None when the peak is given or a spec sheet's) measures the peak
  again: `recalibrate()` keeps the highest reading. A calibration on a shared
  machine reads low when other work takes the cores (on a 2-core Intel Xeon, 321
  and 366 GFLOP/s at the start of two quickstart runs minutes apart), and a low
  peak inflates the MFU; the highest of several readings is the closest to what
  the hardware does."""

  model_flops_per_token: float
  hardware_flops_per_token: float
  peak_flops_per_sec: float  # per device
  num_devices: int
  calibrate: Optional[Callable[[], float]] = None

  def recalibrate(self) -> bool:
    """Measures the peak again (when it was measured) and keeps the higher one;
    returns whether the peak rose."""
    if self.calibrate is None:
      return False
    peak = self.calibrate()
    if peak <= self.peak_flops_per_sec:
      return False
    self.peak_flops_per_sec = peak
    return True

  def mfu(self, tokens_per_sec: float) -> float:
    """Returns the model FLOPs utilisation at `tokens_per_sec` (global tokens)."""
    return mfu(tokens_per_sec, self.model_flops_per_token, self.peak_flops_per_sec,
               self.num_devices)

  def scalars(self, tokens_per_sec: float) -> Dict[str, float]:
    """Returns train/mfu, train/model_flops_per_token and
    train/hardware_flops_per_token at `tokens_per_sec`."""
    return {"train/mfu": self.mfu(tokens_per_sec),
            "train/model_flops_per_token": self.model_flops_per_token,
            "train/hardware_flops_per_token": self.hardware_flops_per_token}


def mfu_meter(cfg: ModelConfig, sequence_length: int, batch_tokens: int, mesh,
              peak_flops_per_sec: Optional[float],
              print_fn: Callable[[str], None]) -> MfuMeter:
  """Returns the run's MfuMeter; prints one line naming the peak and its source."""
  counts = model_flops_per_token(cfg, sequence_length, batch_tokens=batch_tokens)
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  peak, source = resolve_peak_flops(peak_flops_per_sec, cfg.dtype, local[0])
  devices = peak_devices(mesh)
  calibrate = calibration(peak_flops_per_sec, cfg.dtype, local[0])
  measured = calibrate is not None
  print_fn(f"MFU peak: {peak / 1e9:.1f} GFLOP/s per device x {devices} ({source}"
           f"{'; measured again at each evaluation, the highest kept' if measured else ''}"
           f"); model {counts['total'] / 1e6:.2f} MFLOP/token, hardware "
           f"{counts['hardware_total'] / 1e6:.2f} MFLOP/token (training)")
  return MfuMeter(counts["total"], counts["hardware_total"], peak, devices,
                  calibrate)
