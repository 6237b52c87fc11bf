"""cli/environment.py: the CPU is picked when libtpu has no TPU; native noise is
recognised and everything else passes."""
import os
import select
import subprocess
import sys
import time

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


def _fake_host(monkeypatch, accel=(), vfio=(), pci=None):
  """Makes tpu_attached see `accel` under /dev/accel*, `vfio` in /dev/vfio and
  `pci` {device folder: (vendor, device)} under /sys/bus/pci/devices."""
  pci = pci or {}
  real_glob = environment.glob.glob

  def fake_glob(pattern):
    if pattern == "/dev/accel*":
      return list(accel)
    if pattern == "/sys/bus/pci/devices/*/vendor":
      return [f"/sys/bus/pci/devices/{d}/vendor" for d in pci]
    return real_glob(pattern)

  def fake_read(path):
    folder, name = os.path.basename(os.path.dirname(path)), os.path.basename(path)
    return dict(zip(("vendor", "device"), pci[folder]))[name]

  monkeypatch.setattr(environment.glob, "glob", fake_glob)
  monkeypatch.setattr(environment, "_listdir",
                      lambda path: list(vfio) if path == "/dev/vfio" else [])
  monkeypatch.setattr(environment, "_read", fake_read)


def test_a_tpu_shows_as_an_accel_device_a_numbered_vfio_group_or_a_google_pci_chip(
    monkeypatch):
  cases = [
      ({}, False),
      ({"accel": ["/dev/accel0"]}, True),  # v2-v4
      ({"vfio": ["vfio"]}, False),  # the control file alone
      ({"vfio": ["vfio", "0"]}, True),  # v5e and later
      ({"pci": {"0000:00:04.0": ("0x1ae0", "0x0063")}}, True),
      ({"pci": {"0000:00:04.0": ("0x1ae0", "0x0001")}}, False),  # a Google NIC
      ({"pci": {"0000:00:04.0": ("0x10de", "0x0063")}}, False),  # not Google's
      ({"pci": {"0000:00:03.0": ("0x8086", "0x0001"),
                "0000:00:04.0": ("0x1ae0", "0x005e")}}, True),  # any device counts
  ]
  for host, attached in cases:
    _fake_host(monkeypatch, **host)
    assert environment.tpu_attached() is attached, host


def test_unreadable_paths_read_as_empty(tmp_path):
  assert environment._listdir(str(tmp_path / "absent")) == []
  assert environment._read(str(tmp_path / "absent")) == ""
  (tmp_path / "vendor").write_text("0x1ae0\n")
  assert environment._read(str(tmp_path / "vendor")) == "0x1ae0"


def test_a_gpu_device_file_counts_without_asking_for_a_tpu(monkeypatch, tmp_path):
  def no_question():
    raise AssertionError("tpu() asked although a GPU is attached")

  (tmp_path / "nvidia0").write_text("")
  monkeypatch.setattr(environment, "_GPU_DEVICE_FILES",
                      (str(tmp_path / "absent"), str(tmp_path / "nvidia0")))
  assert environment.accelerator_attached(no_question)
  assert not environment.runs_on_cpu({}, tpu=no_question)
  assert environment.pick_platform({}, libtpu_installed=True, tpu=no_question) is None
  monkeypatch.setattr(environment, "_GPU_DEVICE_FILES", (str(tmp_path / "absent"),))
  assert not environment.accelerator_attached(lambda: False)
  assert environment.accelerator_attached(lambda: True)


def test_libtpu_counts_as_installed_from_its_path_variable_or_its_package(monkeypatch):
  found = {"libtpu": None}
  monkeypatch.setattr(environment.importlib.util, "find_spec", found.get)
  assert environment.pick_platform({}, tpu=lambda: False) is None  # no libtpu
  env = {"TPU_LIBRARY_PATH": "/opt/libtpu.so"}
  assert environment.pick_platform(env, tpu=lambda: False) == "cpu"
  assert env["JAX_PLATFORMS"] == "cpu"
  found["libtpu"] = object()
  env = {"TPU_LIBRARY_PATH": ""}
  assert environment.pick_platform(env, tpu=lambda: False) == "cpu"
  assert environment.pick_platform({"JAX_PLATFORMS": ""}, tpu=lambda: False) == "cpu"


def test_raw_logs_are_asked_for_by_the_flag_or_the_variable():
  assert environment.verbose_requested(["openmoe-train", "--verbose"], {})
  assert not environment.verbose_requested(["openmoe-train", "--verbose=1"], {})
  assert environment.verbose_requested(["openmoe-train"], {"OPENMOE_VERBOSE": "1"})
  assert not environment.verbose_requested(["openmoe-train"], {"OPENMOE_VERBOSE": "0"})
  assert not environment.verbose_requested(["openmoe-train"], {"OPENMOE_VERBOSE": ""})
  assert not environment.verbose_requested(["openmoe-train"], {})


def test_a_dangling_module_flag_or_another_package_is_not_one_of_ours():
  assert not environment.is_console_program([], ["python", "-m"])
  assert not environment.is_console_program([], ["python", "-c", "openmoe_jax"])
  assert not environment.is_console_program(["/venv/bin/train-openmoe"], [])
  assert environment.is_console_program([], ["python", "-X", "dev", "-m", "openmoe_jax"])


def _prepare(monkeypatch, argv, jax_imported=False, on_cpu=True, verbose_env=""):
  """Runs prepare_process with spies; returns the names of what it did."""
  from openmoe_jax.cli import host_malloc
  done = []
  monkeypatch.setattr(environment.sys, "argv", argv)
  monkeypatch.setattr(environment.sys, "orig_argv", ["python"] + argv)
  if jax_imported:
    monkeypatch.setitem(environment.sys.modules, "jax", object())
  else:
    monkeypatch.delitem(environment.sys.modules, "jax", raising=False)
  monkeypatch.setenv("OPENMOE_VERBOSE", verbose_env)
  monkeypatch.setattr(environment, "pick_platform", lambda: done.append("platform"))
  monkeypatch.setattr(environment, "runs_on_cpu", lambda: on_cpu)
  monkeypatch.setattr(host_malloc, "reuse_freed_memory", lambda: done.append("malloc"))
  monkeypatch.setattr(environment, "quiet_native_logs", lambda: done.append("quiet"))
  environment.prepare_process()
  return done


def test_prepare_process_picks_the_platform_then_sets_up_only_our_programs(monkeypatch):
  assert _prepare(monkeypatch, ["pytest"]) == ["platform"]
  assert _prepare(monkeypatch, ["/venv/bin/openmoe-train"]) == [
      "platform", "malloc", "quiet"]
  assert _prepare(monkeypatch, ["/venv/bin/openmoe-train"], jax_imported=True) == [
      "quiet"]  # too late for the platform and malloc
  assert _prepare(monkeypatch, ["/venv/bin/openmoe-train"], on_cpu=False) == [
      "platform", "quiet"]
  assert _prepare(monkeypatch, ["/venv/bin/openmoe-train", "--verbose"]) == [
      "platform", "malloc"]
  assert _prepare(monkeypatch, ["/venv/bin/openmoe-train"], verbose_env="1") == [
      "platform", "malloc"]


_FILTERED_CHILD = r"""
import os, sys
from openmoe_jax.cli import environment
env = {"TF_CPP_MIN_LOG_LEVEL": "0"}
first, again = environment.quiet_native_logs(env), environment.quiet_native_logs(env)
filt = environment._FILTER
print(first, again, sorted(env.items()), flush=True)
os.write(2, b"before\nW0000 00:00:1.0 1 port.cc:1] oneDNN custom operations are on\n"
            b"=== Source Location Trace: ===\nreal problem\n")
os.write(2, b"prompt> ")  # a partial line: the parent answers once it sees it
sys.stdin.readline()
os.write(2, b"answer\nnormalizer.cc(51) LOG(INFO) precompiled_charsmap is empty")
filt.close()
print(environment._FILTER is filt, flush=True)
os.write(2, b"after close\n")
"""


def test_the_stderr_filter_drops_noise_and_forwards_the_rest_in_order():
  """In a child process (the filter takes over file descriptor 2). A partial line,
  a prompt, reaches the terminal before the line is finished."""
  proc = subprocess.Popen([sys.executable, "-c", _FILTERED_CHILD], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  seen, deadline = b"", time.monotonic() + 60
  while not seen.endswith(b"prompt> ") and time.monotonic() < deadline:
    if select.select([proc.stderr], [], [], 1.0)[0]:
      chunk = os.read(proc.stderr.fileno(), 4096)
      if not chunk:
        break
      seen += chunk
  if not seen.endswith(b"prompt> "):
    proc.kill()
  out, rest = proc.communicate(b"\n", timeout=60)
  assert proc.returncode == 0, (seen + rest).decode()
  assert seen == b"before\nreal problem\nprompt> "
  assert rest == b"answer\nafter close\n"
  lines = out.decode().splitlines()
  assert lines[0] == ("True True [('GLOG_minloglevel', '2'), ('GRPC_VERBOSITY', 'ERROR'), "
                      "('TF_CPP_MIN_LOG_LEVEL', '0')]")
  assert lines[1] == "True"  # installed once


def test_no_filter_when_the_pipe_cannot_be_made(monkeypatch):
  def no_pipe():
    raise OSError("too many open files")

  monkeypatch.setattr(environment, "_FILTER", None)
  monkeypatch.setattr(environment, "_StderrFilter", no_pipe)
  assert environment.quiet_native_logs({}) is False
  assert environment._FILTER is None
