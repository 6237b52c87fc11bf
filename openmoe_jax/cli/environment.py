"""Process set-up shared by every command-line program, before jax is imported.

Two jobs, both done from `openmoe_jax/__init__.py` (the one module every console
script imports first, before its own module-level `import jax`):

- `pick_platform`: with libtpu installed but no TPU attached, jax would probe for
  one (slow, and libtpu prints errors); choose the CPU instead. An explicit
  JAX_PLATFORMS is never overridden.
- `quiet_native_logs`: TensorFlow, XLA, libtpu and SentencePiece write C++ log lines
  straight to file descriptor 2 (cuInit failures, oneDNN notices, TPU host-bounds
  errors, "precompiled_charsmap is empty"). Log-level variables cannot silence all
  of them (TensorFlow prints some before it reads TF_CPP_MIN_LOG_LEVEL), so fd 2 is
  routed through a filter thread that drops the known noise and passes everything
  else. `--verbose` on the command line (or OPENMOE_VERBOSE=1) keeps the raw logs.
"""
import atexit
import glob
import importlib.util
import os
import re
import select
import sys
import threading
from typing import Callable, MutableMapping, Optional, Sequence

from openmoe_jax.cli import host_malloc

_GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device ids of TPU chips (as jax's hardware_utils lists them).
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f",
                    "0x0076"}
_GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")

# Lines that are never news to a user of these programs.
NOISE_PATTERNS = tuple(re.compile(p) for p in (
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called",
    r"^WARNING: Logging before InitGoogle\(\) is written to STDERR",
    # Informational C++ log lines (glog/absl "I" severity) of any library.
    r"^I\d{4} [\d:. ]+\s+\d+ [\w.-]+:\d+\] ",
    r"^[WE]\d{4} .*\] (failed call to cuInit|oneDNN custom operations"
    r"|Could not find cuda drivers|Unable to register cu|TF-TRT Warning)",
    r"^To enable the following instructions: .* rebuild TensorFlow",
    # libtpu probing the machine it runs on (none attached, or a topology compile).
    r"^Failed to find host bounds for accelerator type",
    r"^[WE]\d{4} .*\] .*(unexpected worker hostname|could not determine TPU)",
    r"^=== Source Location Trace: ===",
    r"^(learning|third_party|platforms|tensorflow|xla)/\S+:\d+\s*$",
    r"^normalizer\.cc\(\d+\) LOG\(INFO\) precompiled_charsmap is empty",
))


def tpu_attached() -> bool:
  """Returns whether this machine shows a TPU: /dev/accel* (v2-v4), /dev/vfio/<n>
  (v5e and later) or a Google PCI device with a TPU device id."""
  if glob.glob("/dev/accel*") or any(
      name.isdigit() for name in _listdir("/dev/vfio")):
    return True
  for vendor_path in glob.glob("/sys/bus/pci/devices/*/vendor"):
    if _read(vendor_path) == _GOOGLE_PCI_VENDOR and _read(
        os.path.join(os.path.dirname(vendor_path), "device")) in _TPU_PCI_DEVICES:
      return True
  return False


def _listdir(path: str) -> list:
  try:
    return os.listdir(path)
  except OSError:
    return []


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return ""


def accelerator_attached(tpu: Optional[Callable[[], bool]] = None) -> bool:
  """Returns whether a GPU (an NVIDIA or ROCm device file) or a TPU (`tpu`, default
  `tpu_attached`; not asked when a GPU is found) is attached to this host."""
  return any(os.path.exists(p) for p in _GPU_DEVICE_FILES) or (tpu or tpu_attached)()


def pick_platform(environ: MutableMapping[str, str] = os.environ,
                  libtpu_installed: Optional[bool] = None,
                  tpu: Optional[Callable[[], bool]] = None) -> Optional[str]:
  """Sets JAX_PLATFORMS=cpu in `environ` when libtpu is installed but neither a TPU
  nor a GPU is attached and JAX_PLATFORMS is unset; returns the value set, or None
  when nothing was changed."""
  if environ.get("JAX_PLATFORMS"):
    return None
  if libtpu_installed is None:
    libtpu_installed = bool(environ.get("TPU_LIBRARY_PATH")) or (
        importlib.util.find_spec("libtpu") is not None)
  if not libtpu_installed or accelerator_attached(tpu):
    return None
  environ["JAX_PLATFORMS"] = "cpu"
  return "cpu"


def is_noise(line: str) -> bool:
  """Returns whether a stderr line is known native-library noise."""
  return any(p.search(line) for p in NOISE_PATTERNS)


class _StderrFilter:
  """Routes file descriptor 2 through a pipe; a thread forwards the lines that are
  not noise to the original stderr."""

  def __init__(self):
    sys.stderr.flush()
    self._target = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    self._read_fd = read_fd
    self._thread = threading.Thread(target=self._pump, name="stderr-filter",
                                    daemon=True)
    self._thread.start()
    atexit.register(self.close)

  def _forward(self, data: bytes) -> None:
    os.write(self._target, data)

  def _pump(self) -> None:
    pending = b""
    while True:
      ready, _, _ = select.select([self._read_fd], [], [], 0.2)
      if not ready:  # a partial line (a prompt, a progress bar) waits no longer
        if pending:
          self._forward(pending)
          pending = b""
        continue
      chunk = os.read(self._read_fd, 65536)
      if not chunk:
        break
      *lines, pending = (pending + chunk).split(b"\n")
      kept = [l for l in lines if not is_noise(l.decode("utf-8", "replace"))]
      if kept:
        self._forward(b"".join(l + b"\n" for l in kept))
    if pending and not is_noise(pending.decode("utf-8", "replace")):
      self._forward(pending)

  def close(self) -> None:
    """Puts the original stderr back and forwards what is still in the pipe."""
    try:
      sys.stderr.flush()
    except (OSError, ValueError):
      pass
    os.dup2(self._target, 2)  # closes the pipe's last writer: the thread sees EOF
    self._thread.join(timeout=2.0)


_FILTER: Optional[_StderrFilter] = None


def quiet_native_logs(environ: MutableMapping[str, str] = os.environ) -> bool:
  """Lowers native log levels (setdefault only) and filters fd 2 once per process;
  returns whether the filter is (now) installed."""
  global _FILTER
  environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  environ.setdefault("GRPC_VERBOSITY", "ERROR")
  environ.setdefault("GLOG_minloglevel", "2")
  if _FILTER is None:
    try:
      _FILTER = _StderrFilter()
    except OSError:
      return False
  return True


def verbose_requested(argv: Sequence[str], environ=os.environ) -> bool:
  """Returns whether raw logs were asked for (--verbose or OPENMOE_VERBOSE=1)."""
  return "--verbose" in argv or environ.get("OPENMOE_VERBOSE", "") not in ("", "0")


def is_console_program(argv: Sequence[str], orig_argv: Sequence[str]) -> bool:
  """Returns whether this process runs one of the library's programs: an
  `openmoe-*` console script or `python -m openmoe_jax...`."""
  if argv and os.path.basename(argv[0]).startswith("openmoe-"):
    return True
  args = list(orig_argv)
  return any(a == "-m" and i + 1 < len(args) and args[i + 1].startswith("openmoe_jax")
             for i, a in enumerate(args))


def prepare_process() -> None:
  """Called on `import openmoe_jax`: picks the platform (if jax is not imported
  yet) and, in the library's own programs, lets malloc reuse freed memory on the
  CPU (host_malloc.py) and hides native log noise. Returns None."""
  if "jax" not in sys.modules:
    pick_platform()
  if not is_console_program(sys.argv, getattr(sys, "orig_argv", [])):
    return
  if "jax" not in sys.modules and runs_on_cpu():
    host_malloc.reuse_freed_memory()
  if not verbose_requested(sys.argv):
    quiet_native_logs()


def runs_on_cpu(environ: MutableMapping[str, str] = os.environ,
                tpu: Optional[Callable[[], bool]] = None) -> bool:
  """Returns whether jax will run on the CPU: JAX_PLATFORMS is "cpu", or unset with
  neither a TPU nor a GPU attached."""
  if environ.get("JAX_PLATFORMS"):
    return environ["JAX_PLATFORMS"].strip().lower() == "cpu"
  return not accelerator_attached(tpu)
