"""Which device the kernels are built for: the attached one, or a compile target.

Kernels choose their path at trace time from the target's `device_kind`: Pallas
Mosaic kernels on TPU (bf16 matmuls from v4 on, f32 on v3), interpret mode or XLA
fallbacks elsewhere. Ahead-of-time compiles on a CPU host for a TPU topology
(`jax.experimental.topologies`) set the target explicitly:

  with compile_target(topology_devices("v3:2x2")[0]):
    jax.jit(step).lower(*abstract_args).compile()

The target is read when a function is traced; use a fresh `jax.jit` per target (a
jitted function traced for one target is cached for the next).
"""
import contextlib
import contextvars
import re
from typing import Iterator, Optional, Union

import jax

_TARGET_KIND = contextvars.ContextVar("openmoe_jax_kernel_target", default=None)
_GENERATION = re.compile(r"TPU( v)?(\d+)")


@contextlib.contextmanager
def compile_target(device: Union[str, "jax.Device"]) -> Iterator[str]:
  """Within the block, kernels are traced for `device` (a Device or a device_kind
  string such as "TPU v3"); yields the device_kind."""
  kind = device if isinstance(device, str) else device.device_kind
  token = _TARGET_KIND.set(kind)
  try:
    yield kind
  finally:
    _TARGET_KIND.reset(token)


def target_kind() -> str:
  """Returns the device_kind kernels are traced for (compile target or device 0)."""
  return _TARGET_KIND.get() or jax.devices()[0].device_kind


def on_tpu() -> bool:
  """Returns whether the kernels target a TPU."""
  return "TPU" in target_kind()


def tpu_generation() -> Optional[int]:
  """Returns the TPU generation number of the target (3 for "TPU v3"), None if the
  target is not a TPU."""
  match = _GENERATION.match(target_kind())
  return int(match[2]) if match else None


def bf16_matmul_ok() -> bool:
  """Returns whether Mosaic matmuls may take bf16 inputs (not on TPU v3 and older)."""
  generation = tpu_generation()
  return generation is None or generation >= 4
