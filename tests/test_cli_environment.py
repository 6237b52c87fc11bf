"""cli/environment.py: the CPU is picked when libtpu has no TPU; native noise is
recognised and everything else passes."""
import os
import subprocess
import sys

from openmoe_jax.cli import environment


def test_picks_cpu_when_libtpu_is_installed_but_no_tpu():
  env = {}
  assert environment.pick_platform(env, libtpu_installed=True, tpu=lambda: False) == "cpu"
  assert env == {"JAX_PLATFORMS": "cpu"}


def test_never_overrides_an_explicit_platform_or_a_present_tpu():
  env = {"JAX_PLATFORMS": "tpu"}
  assert environment.pick_platform(env, libtpu_installed=True, tpu=lambda: False) is None
  assert env == {"JAX_PLATFORMS": "tpu"}
  env = {}
  assert environment.pick_platform(env, libtpu_installed=True, tpu=lambda: True) is None
  assert environment.pick_platform(env, libtpu_installed=False, tpu=lambda: False) is None
  assert env == {}


def test_noise_lines_are_recognised_and_real_problems_are_not():
  noise = [
      "WARNING: All log messages before absl::InitializeLog() is called are written "
      "to STDERR",
      "I0000 00:00:1796065841.428821    2453 port.cc:153] oneDNN custom operations are on.",
      "E0000 00:00:1796065843.685670    2453 cuda_platform.cc:52] failed call to cuInit: "
      "INTERNAL: CUDA error",
      "Failed to find host bounds for accelerator type: WARNING: could not determine",
      "E0000 00:00:1796065849.445962    2453 common_lib.cc:554] INVALID_ARGUMENT: Error: "
      "unexpected worker hostname 'WARNING: could not determine TPU worker hostnames'",
      "=== Source Location Trace: === ",
      "learning/45eac/tfrc/runtime/libtpu_init_utils.cc:327",
      "normalizer.cc(51) LOG(INFO) precompiled_charsmap is empty. use identity "
      "normalization.",
  ]
  for line in noise:
    assert environment.is_noise(line), line
  for line in ["Traceback (most recent call last):", "openmoe-train: error: bad",
               "E0000 00:00:1.0 1 pjrt.cc:1] RESOURCE_EXHAUSTED: out of memory",
               "Ctrl-C: finishing the step in flight"]:
    assert not environment.is_noise(line), line


def test_console_programs_are_recognised():
  assert environment.is_console_program(["/venv/bin/openmoe-train"], [])
  assert environment.is_console_program(
      ["-m"], ["python", "-m", "openmoe_jax.cli.train", "--help"])
  assert not environment.is_console_program(["pytest"], ["python", "-m", "pytest"])


def test_malloc_settings_are_applied_unless_opted_out():
  from openmoe_jax.cli import host_malloc
  calls = []
  record = lambda param, value: calls.append((param, value)) or 1
  assert host_malloc.reuse_freed_memory({}, mallopt=record)
  assert calls == [(-8, 1), (-4, 0), (-1, 2**31 - 1)]  # arena max, mmap max, trim
  calls.clear()
  assert not host_malloc.reuse_freed_memory({"OPENMOE_MALLOC": "default"}, mallopt=record)
  assert calls == []
  assert not host_malloc.reuse_freed_memory({}, mallopt=lambda p, v: 0)  # refused
  # glibc itself accepts them (in a child: they would change this process's malloc).
  out = subprocess.run(
      [sys.executable, "-c", "from openmoe_jax.cli import host_malloc; "
       "print(host_malloc.reuse_freed_memory({}))"],
      capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "True"


def test_runs_on_cpu_follows_jax_platforms_then_the_attached_devices():
  assert environment.runs_on_cpu({"JAX_PLATFORMS": "cpu"})
  assert not environment.runs_on_cpu({"JAX_PLATFORMS": "tpu"})
  assert not environment.runs_on_cpu({"JAX_PLATFORMS": "cuda,cpu"})
  assert not environment.runs_on_cpu({}, tpu=lambda: True)
  assert environment.runs_on_cpu({}, tpu=lambda: False) == (
      not any(os.path.exists(p) for p in environment._GPU_DEVICE_FILES))
