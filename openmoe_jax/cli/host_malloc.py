"""glibc malloc settings that let a CPU training process reuse its freed memory.

XLA:CPU allocates every step's temporaries (activations, gradients: hundreds of MB)
with malloc and frees them at the end of the step. With glibc's defaults, buffers
this large come from fresh mmap()s (or from per-thread arenas that give memory back
to the kernel), so every step touches new pages and the kernel zero-fills each one:
in the quickstart 1.6M page faults in 13 steps, 0.80 s per step. One arena, no mmap
for large blocks and no trimming of the heap's top keep the freed memory mapped for
the next step: 0.57M page faults, 0.64 s per step (measured on a 2-core AVX-512 CPU,
same process otherwise). The cost is that the process keeps its high-water memory:
peak RSS 2.8 instead of 2.2 GB for the bare quickstart train step (those 13 steps
on synthetic tokens), 4.8 instead of 2.4 GB for the whole quickstart run (its data
pipeline, evaluation and checkpoints included; the README's figure).

`reuse_freed_memory` applies them with mallopt(3) before jax is imported, in the
library's programs when the run is on the CPU (`openmoe_jax/__init__.py` ->
`environment.prepare_process`). OPENMOE_MALLOC=default keeps glibc's defaults.
"""
import ctypes
import os
import platform
import sys
from typing import Callable, MutableMapping, Optional

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))


def reuse_freed_memory(environ: MutableMapping[str, str] = os.environ,
                       mallopt: Optional[Callable[[int, int], int]] = None) -> bool:
  """Applies SETTINGS with glibc's mallopt; returns whether all were accepted
  (False off Linux/glibc, or with OPENMOE_MALLOC=default)."""
  if environ.get("OPENMOE_MALLOC", "") == "default":
    return False
  if mallopt is None:
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
      return False
    mallopt = ctypes.CDLL(None).mallopt
  return all([mallopt(param, value) == 1 for param, value in SETTINGS])
