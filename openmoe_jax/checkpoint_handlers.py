"""The Orbax handlers behind `checkpoints.Checkpointer`: the train state's (Orbax's
standard pytree format, replicated arrays written in parts only when the parts are
large), the fault-injection JSON handler of the tests, and the silencing of the
reads that a failed checkpoint read abandons."""
import contextlib
import gc
import os
import sys
import time
import traceback
from typing import Any

import jax
import orbax.checkpoint as ocp
# Orbax's default per-array metadata store (not exported; orbax is pinned < 0.13).
from orbax.checkpoint._src.metadata import array_metadata_store


class DelayedJsonHandler(ocp.JsonCheckpointHandler):
  """Orbax's JSON handler whose background write first sleeps `delay_s` seconds
  (the fault-injection hook of `Checkpointer.debug_save_delay_s`)."""

  def __init__(self, delay_s: float):
    super().__init__()
    self._delay_s = delay_s

  async def _save_fn(self, x, directory):
    time.sleep(self._delay_s)  # runs in Orbax's background commit thread
    await super()._save_fn(x, directory)


# A replicated array is written in parts, one per replica, only when each part holds
# at least this many bytes (the default of Checkpointer's
# `replica_parallel_min_slice_bytes`).
# Orbax's default (always) slices even a norm scale into one part per device, each
# slice a program compiled per shape and device: with 8 data-parallel replicas the
# first save of a 0.6M-parameter state took 3.9 s instead of 0.1 s, and every later
# one twice as long. Larger arrays keep the parallel write.
REPLICA_PARALLEL_MIN_SLICE_BYTES = 1 << 20


class StateHandler(ocp.StandardCheckpointHandler):
  """Orbax's StandardCheckpointHandler (same format, same options) whose jax.Array
  handler writes a replicated array in parts only from `min_slice_bytes` per part
  (0: always, Orbax's default)."""

  def __init__(self, min_slice_bytes: int = REPLICA_PARALLEL_MIN_SLICE_BYTES):
    super().__init__()
    arrays = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(),
        min_slice_bytes_for_replica_parallel=min_slice_bytes)
    registry = ocp.type_handlers.create_type_handler_registry(*[
        (ty, ocp.type_handlers.get_type_handler(ty))
        for ty in ocp.type_handlers.supported_types() if ty is not jax.Array
    ], (jax.Array, arrays))
    # StandardCheckpointHandler delegates to a PyTreeCheckpointHandler built with
    # orbax's global type handlers; this one takes the registry above and the same
    # settings as StandardCheckpointHandler's defaults.
    self._impl = ocp.PyTreeCheckpointHandler(
        save_concurrent_gb=96, restore_concurrent_gb=96,
        type_handler_registry=registry)


def _is_closed_loop_callback(unraisable: Any) -> bool:
  """True for asyncio's RuntimeError('Event loop is closed') raised inside
  `call_soon_threadsafe`: a read that finished after its event loop was closed."""
  error = unraisable.exc_value
  if not isinstance(error, RuntimeError) or str(error) != "Event loop is closed":
    return False
  base_events = os.path.join("asyncio", "base_events.py")
  return any(frame.name == "call_soon_threadsafe" and frame.filename.endswith(base_events)
             for frame in traceback.extract_tb(unraisable.exc_traceback))


class AbandonedReadsFilter:
  """An unraisable hook that drops `_is_closed_loop_callback` errors and passes
  everything else to the hook it replaced (`previous`)."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, unraisable: Any) -> None:
    if not _is_closed_loop_callback(unraisable):
      self.previous(unraisable)


def _drop_unraisable(unraisable: Any) -> None:
  del unraisable


@contextlib.contextmanager
def quiet_failed_reads():
  """Runs a checkpoint read (a restore, a metadata read) whose failure prints
  nothing but the exception it raises.

  When one array fails to read, Orbax abandons the reads of the others. Their
  coroutines would print the same failure, with a page of TensorStore spec each,
  when collected: inside the block every unraisable error is dropped, and a failure
  collects them before the hook is restored. Reads still running when the block
  ends are covered by `filter_abandoned_reads`, installed after a failure."""
  previous, sys.unraisablehook = sys.unraisablehook, _drop_unraisable
  failed = False
  try:
    yield
  except Exception:
    failed = True
    gc.collect()
    raise
  finally:
    sys.unraisablehook = previous
    if failed:
      filter_abandoned_reads()


def filter_abandoned_reads() -> None:
  """Installs `AbandonedReadsFilter` over the current unraisable hook, once.

  When Orbax fails to read a damaged checkpoint (a restore, or its metadata) it
  closes its event loop while TensorStore is still reading the other arrays. When
  such a read finishes, its completion callback finds the loop closed, and Python
  prints "Exception ignored in: None ... RuntimeError: Event loop is closed",
  seconds after the fallback has moved on. The filter drops exactly that error,
  whenever it arrives."""
  if not isinstance(sys.unraisablehook, AbandonedReadsFilter):
    sys.unraisablehook = AbandonedReadsFilter(sys.unraisablehook)
