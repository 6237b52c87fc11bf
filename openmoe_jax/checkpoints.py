"""Orbax checkpoints of the train state plus the data pipeline position.

Layout: `<model_dir>/checkpoints/<step>/{state,data_position}`; `state` is a standard
pytree checkpoint (restorable into any sharding), `data_position` a small JSON dict
(e.g. examples consumed) so a resumed run continues the data stream where it stopped.

Faults (each raises one exception type naming the directory and the cause):
- an unwritable MODEL_DIR: `check_writable` -> `UnwritableDirectoryError`, before any
  compile;
- a save that fails (disk full, I/O error), synchronously or in the background:
  `CheckpointSaveError`; checkpoints already on disk are left as they were;
- a damaged checkpoint (a file truncated or missing, unreadable metadata):
  `Checkpointer.restore` names it and falls back to the previous complete one
  (`Checkpointer.restore_fallback`), moving the damaged one to
  `<model_dir>/damaged_checkpoints/`; `CheckpointDamagedError` when none is readable;
- partial saves (`<step>.orbax-checkpoint-tmp*` of a process killed mid-write) are
  never restored; `remove_partial_saves` deletes them;
- a state holding NaN/Inf is never saved: `NonFiniteStateError`;
- a checkpoint that does not fit the model being restored (a changed d_model,
  number of experts, vocabulary, layers): `CheckpointMismatchError` naming the
  parameter and both shapes, raised before Orbax reads anything; nothing on disk
  changes.

Fault-injection hook (tests only): `Checkpointer.debug_save_delay_s` (gin) or the
environment variable OPENMOE_JAX_DEBUG_SAVE_DELAY_S delays the end of every
background save by that many seconds, so that a test can kill the process while a
checkpoint is being written.
"""
import logging
import os
import shutil
from typing import Any, Callable, Optional

from etils import epath
import gin
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from openmoe_jax import errors
from openmoe_jax.checkpoint_handlers import (REPLICA_PARALLEL_MIN_SLICE_BYTES,
                                             DelayedJsonHandler, StateHandler,
                                             quiet_failed_reads)

_STATE = "state"
_DATA_POSITION = "data_position"
DAMAGED_DIR = "damaged_checkpoints"
TMP_MARKER = ".orbax-checkpoint-tmp"
# Orbax's messages for a checkpoint that does not fit the requested state: the
# checkpoint is fine, the configuration changed, so no older one would fit either.
# (A restore without target shardings on another device count says "Topology
# mismatch"; the trainer always passes the new mesh's shardings.)
_MISMATCH_MARKERS = ("is not compatible with the stored shape", "Structure mismatch",
                     "Topology mismatch")


# Fault injection (tests): seconds every background save waits inside its window.
DEBUG_SAVE_DELAY_ENV = "OPENMOE_JAX_DEBUG_SAVE_DELAY_S"


class CheckpointError(errors.RunError):
  """Base of the checkpoint faults below; `directory` is the path concerned."""

  def __init__(self, message: str, directory: str, step: Optional[int] = None):
    super().__init__(message)
    self.directory, self.step = directory, step


class UnwritableDirectoryError(CheckpointError):
  """MODEL_DIR (or its checkpoints folder) cannot be created or written."""


class CheckpointSaveError(CheckpointError):
  """A save failed; the checkpoints saved before it are intact."""


class NonFiniteStateError(CheckpointError):
  """A state to be saved holds NaN or Inf; nothing was written."""


class CheckpointMismatchError(CheckpointError, errors.InputError):
  """A checkpoint does not fit the state being restored (changed configuration).

  `mismatches`: [(parameter path, checkpoint shape or None, model shape or None)]."""

  def __init__(self, message: str, directory: str, step: Optional[int] = None,
               mismatches: tuple = ()):
    super().__init__(message, directory, step)
    self.mismatches = list(mismatches)


class CheckpointDamagedError(CheckpointError):
  """A checkpoint could not be read (and no fallback was allowed or possible).

  `damaged`: [(step, path, reason)] of every checkpoint that failed to read."""

  def __init__(self, message: str, directory: str, step: Optional[int] = None,
               damaged: tuple = ()):
    super().__init__(message, directory, step)
    self.damaged = list(damaged)


def _reason(error: BaseException) -> str:
  """Returns a one-line description of `error` (type and first line)."""
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0] if text else ''}"[:500]


def check_writable(model_dir: str) -> None:
  """Creates `model_dir` and `model_dir/checkpoints` if needed and writes, then
  deletes, a probe file in each; returns None.

  Raises UnwritableDirectoryError naming the directory and the OS reason
  (permission denied, read-only file system, a file in the way, disk full).
  """
  for directory in (os.fspath(model_dir),
                    os.path.join(os.fspath(model_dir), "checkpoints")):
    path = epath.Path(directory)
    probe = path / f".write_probe_{os.getpid()}"
    try:
      path.mkdir(parents=True, exist_ok=True)
      probe.write_text("ok")
      probe.unlink()
    except Exception as e:  # gs:// raises its own types; all mean "cannot write"
      raise UnwritableDirectoryError(
          f"MODEL_DIR {model_dir} is not writable ({directory}): {_reason(e)}",
          directory) from e


@gin.configurable(denylist=["model_dir", "print_fn"])
class Checkpointer:
  """Saves every `save_every_steps` steps (or when forced, or on preemption) and keeps
  the last `keep` checkpoints (keep=None keeps all).

  Saving is asynchronous: `save` returns once device arrays are copied out; call
  `wait_until_finished()` before reading a checkpoint back or exiting (`close()` does).
  A failed save raises CheckpointSaveError from `save` (or, when it failed in the
  background, from the next `save`, `wait_until_finished` or `close`).

  `restore_fallback` (gin: `Checkpointer.restore_fallback`): when the latest
  checkpoint is damaged, True (the default, the safe choice) says which one and why
  and restores the previous complete one; False stops with CheckpointDamagedError.
  Either way a run never silently starts from scratch. `print_fn` receives those
  messages (default: logging.warning).

  `replica_parallel_min_slice_bytes` (gin): a replicated array is written in parts,
  one per replica (on a pod, by several hosts), only when each part holds at least
  this many bytes (default REPLICA_PARALLEL_MIN_SLICE_BYTES, 1 MiB; why and what it
  measured: checkpoint_handlers.py); below it one replica writes it whole. 0 is
  Orbax's default, always in parts.

  `debug_save_delay_s` (or the environment variable DEBUG_SAVE_DELAY_ENV): a
  fault-injection hook for tests, never for real runs: every background save sleeps
  that long before it writes its last item, with the checkpoint still a partial
  `<step>.orbax-checkpoint-tmp*` folder, so that a test can kill the process there.
  """

  def __init__(self, model_dir: str, save_every_steps: int = 1000, keep: int | None = 3,
               restore_fallback: bool = True,
               print_fn: Optional[Callable[[str], None]] = None,
               debug_save_delay_s: float = 0.0,
               replica_parallel_min_slice_bytes: int = REPLICA_PARALLEL_MIN_SLICE_BYTES):
    if save_every_steps < 1:
      raise ValueError(f"save_every_steps must be >= 1, got {save_every_steps}")
    if replica_parallel_min_slice_bytes < 0:
      raise ValueError("replica_parallel_min_slice_bytes must be >= 0, got "
                       f"{replica_parallel_min_slice_bytes}")
    self.model_dir = os.fspath(model_dir)
    self.directory = os.path.join(self.model_dir, "checkpoints")
    self.restore_fallback = bool(restore_fallback)
    self.print_fn = print_fn or logging.warning
    self._pending_step = None  # the step whose save may still be in the background
    self.restored_step = None  # the step `restore` returned last
    # Orbax's default policy also saves the first step it sees; a run should only
    # save on multiples of save_every_steps, on preemption, and when forced.
    policy = ocp.checkpoint_managers.AnySavePolicy([
        ocp.checkpoint_managers.FixedIntervalPolicy(save_every_steps),
        ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
    ])
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policy, max_to_keep=keep, create=True)
    delay = float(debug_save_delay_s or os.environ.get(DEBUG_SAVE_DELAY_ENV) or 0)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    json_handler = DelayedJsonHandler(delay) if delay > 0 else ocp.JsonCheckpointHandler()
    registry.add(_DATA_POSITION, ocp.args.JsonSave, json_handler)
    registry.add(_DATA_POSITION, ocp.args.JsonRestore, json_handler)
    state_handler = StateHandler(replica_parallel_min_slice_bytes)
    registry.add(_STATE, ocp.args.StandardSave, state_handler)
    registry.add(_STATE, ocp.args.StandardRestore, state_handler)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, handler_registry=registry)

  def save(self, step: int, state: Any, data_position: dict | None = None,
           force: bool = False) -> bool:
    """Saves `state` (a pytree of arrays) and `data_position` (JSON-able dict) at
    `step` if the step is due or `force`. Returns whether a save was started.

    Raises CheckpointSaveError when this save, or the previous one still being
    written in the background, fails; earlier checkpoints stay intact.
    """
    # A background save that failed surfaces at the first call after it ended;
    # a due save waits for the previous one anyway (Orbax would), here so that a
    # failure is reported with the step it belongs to. should_save is evaluated on
    # every call, as Orbax's save does, so that all hosts take the same path.
    due = force or self._manager.should_save(int(step))
    if due:
      self._check_finite(int(step), state)
    if self._pending_step is not None and (
        due or not self._manager.is_saving_in_progress()):
      self.wait_until_finished()
    args = ocp.args.Composite(**{
        _STATE: ocp.args.StandardSave(state),
        _DATA_POSITION: ocp.args.JsonSave(dict(data_position or {})),
    })
    try:
      started = self._manager.save(int(step), args=args, force=force)
    except Exception as e:
      raise self._save_error(int(step), e) from e
    if started:
      self._pending_step = int(step)
    return started

  def is_save_due(self, step: int) -> bool:
    """Returns whether `save(step, ...)` without force would save."""
    return bool(self._manager.should_save(int(step)))

  def _check_finite(self, step: int, state: Any) -> None:
    """Raises NonFiniteStateError naming the leaves of `state` holding NaN/Inf."""
    paths, leaves = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      dtype = getattr(leaf, "dtype", None)
      if dtype is not None and jnp.issubdtype(dtype, jnp.inexact):
        paths.append(jax.tree_util.keystr(path))
        leaves.append(leaf)
    if not leaves:
      return
    bad = [p for p, ok in zip(paths, np.asarray(_all_finite(leaves))) if not ok]
    if bad:
      raise NonFiniteStateError(
          f"not saving the checkpoint of step {step}: the state holds NaN or Inf in "
          f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. The checkpoints "
          f"already saved are intact (steps {self.all_steps_on_disk() or 'none'}).",
          self.directory, step)

  def _save_error(self, step: int, error: BaseException) -> CheckpointSaveError:
    """Returns the CheckpointSaveError for a failed save of `step` (and makes
    the step list match the disk again: Orbax drops the oldest step from it when a
    save starts, and deletes it from disk only once that save is committed)."""
    try:
      self._manager.reload()
    except Exception:  # pylint: disable=broad-except
      pass  # the original error is the one to report
    kept = self.all_steps_on_disk()
    return CheckpointSaveError(
        f"saving the checkpoint of step {step} in {self.directory} failed: "
        f"{_reason(error)}. The checkpoints already saved are intact "
        f"(steps {kept or 'none'}); free space or fix the storage, then run the "
        "same command again to resume from the latest.", self.directory, step)

  def all_steps_on_disk(self) -> list[int]:
    """Returns the finalized steps found in the directory now, oldest first."""
    try:
      names = os.listdir(self.directory)
    except OSError:
      return []
    return sorted(int(n) for n in names if n.isdigit())

  def latest_step(self) -> int | None:
    """Returns the newest saved step, or None when there is no checkpoint."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Returns the saved steps, oldest first."""
    return sorted(self._manager.all_steps())

  def restore(self, step: int | None = None, abstract_state: Any = None,
              fallback: Optional[bool] = None) -> tuple[Any, dict]:
    """Returns (state, data_position) saved at `step` (default: the latest).

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` carrying `.sharding`
    (e.g. `jax.eval_shape` output with shardings attached); arrays are restored
    directly into those shardings, with the dtypes given there. Without it, arrays
    come back as saved, on the default device. Raises FileNotFoundError when no
    checkpoint exists.

    With `step` None, a damaged latest checkpoint is reported through `print_fn`
    (path and reason) and, when `fallback` (default: `self.restore_fallback`),
    moved to `<model_dir>/damaged_checkpoints/` and the previous one tried, and so
    on; `self.restored_step` tells which step came back. Raises
    CheckpointDamagedError when fallback is off or no checkpoint is readable, and
    CheckpointMismatchError (a ValueError), before reading any array, when the
    stored arrays' shapes or paths differ from `abstract_state` (a changed
    configuration, not damage: nothing is moved). Orbax's own ValueError for a
    mismatch its metadata did not show is re-raised unchanged. An explicit `step`
    never falls back.
    """
    fallback = self.restore_fallback if fallback is None else fallback
    steps = [int(step)] if step is not None else self.all_steps()[::-1]
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    damaged = []
    for candidate in steps:
      if abstract_state is not None:
        self._check_fits(candidate, abstract_state)
      try:
        state, position = self._restore_step(candidate, abstract_state)
      except Exception as e:  # pylint: disable=broad-except
        if any(marker in str(e) for marker in _MISMATCH_MARKERS):
          raise
        damaged.append((candidate, self._step_path(candidate), _reason(e)))
        self.print_fn(f"Checkpoint {self._step_path(candidate)} is damaged: "
                      f"{_reason(e)}")
        if step is not None or not fallback:
          raise self._damaged_error(damaged, fallback_off=step is None) from e
        continue
      self._set_aside(damaged)
      if damaged:
        self.print_fn(f"Falling back to the checkpoint of step {candidate} "
                      f"({self._step_path(candidate)})")
      self.restored_step = candidate
      return state, position
    raise self._damaged_error(damaged, fallback_off=False)

  def _check_fits(self, step: int, abstract_state: Any) -> None:
    """Raises CheckpointMismatchError when the stored arrays of `step` differ from
    `abstract_state` in shape or in parameter paths; returns None when they fit or
    the metadata cannot be read (the restore then reports the damage)."""
    try:
      with quiet_failed_reads():
        stored = ocp.StandardCheckpointHandler().metadata(
            epath.Path(self._step_path(step)) / _STATE)
      stored = _flat_shapes(getattr(stored, "tree", stored))
    except Exception:  # pylint: disable=broad-except
      return
    wanted = _flat_shapes(abstract_state)
    mismatches = [(p, stored.get(p), wanted.get(p))
                  for p in sorted(set(stored) | set(wanted))
                  if stored.get(p) != wanted.get(p)]
    if not mismatches:
      return
    # Parameters first: an optimizer moment repeats its parameter's mismatch.
    mismatches.sort(key=lambda m: not m[0].startswith("params/"))
    shown = "; ".join(
        f"{path}: checkpoint {_shape_text(saved)}, model {_shape_text(model)}"
        for path, saved, model in mismatches[:3])
    more = f" (and {len(mismatches) - 3} more)" if len(mismatches) > 3 else ""
    raise CheckpointMismatchError(
        f"the checkpoint {self._step_path(step)} does not fit the configured model: "
        f"{shown}{more}. The configuration changed since it was saved: restore the "
        "old gin settings, or train in a new MODEL_DIR; nothing was modified.",
        self.directory, step, mismatches)

  def _restore_step(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Returns (state, data_position) of `step`; raises whatever Orbax raises."""
    with quiet_failed_reads():
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          _STATE: ocp.args.StandardRestore(abstract_state),
          _DATA_POSITION: ocp.args.JsonRestore(),
      }))
    return restored[_STATE], dict(restored[_DATA_POSITION] or {})

  def _step_path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _damaged_error(self, damaged, fallback_off: bool) -> CheckpointDamagedError:
    """Returns the CheckpointDamagedError listing `damaged` [(step, path, why)]."""
    listing = "; ".join(f"{path}: {why}" for _, path, why in damaged)
    if fallback_off:
      advice = ("Checkpointer.restore_fallback is False; set it to True to resume "
                "from the previous complete checkpoint, or move the damaged one away")
    elif len(damaged) == 1:
      advice = "restore it from a backup or move it away"
    else:
      advice = (f"none of the {len(damaged)} checkpoints in {self.directory} is "
                "readable; restore them from a backup or use a new MODEL_DIR")
    return CheckpointDamagedError(f"damaged checkpoint(s): {listing}. {advice}.",
                                  self.directory, damaged[-1][0], damaged)

  def _set_aside(self, damaged) -> None:
    """Moves each damaged step to <model_dir>/damaged_checkpoints/ (kept for
    inspection; a later save of that step must not collide with it)."""
    if not damaged:
      return
    if jax.process_index() == 0:
      aside = os.path.join(self.model_dir, DAMAGED_DIR)
      os.makedirs(aside, exist_ok=True)
      for step, path, _ in damaged:
        target, n = os.path.join(aside, str(step)), 1
        while os.path.exists(target):
          target, n = os.path.join(aside, f"{step}.{n}"), n + 1
        shutil.move(path, target)
        self.print_fn(f"Moved the damaged checkpoint {path} to {target}")
    self._manager.reload()

  def remove_partial_saves(self) -> list[str]:
    """Deletes `<step>.orbax-checkpoint-tmp*` folders, the leftovers of saves
    interrupted mid-write (never restored: Orbax lists finalized steps only);
    returns their paths. Call it from the one process that writes (a trainer
    starting), never while another process may be saving into the directory."""
    removed = []
    if jax.process_index() != 0 or not os.path.isdir(self.directory):
      return removed
    for name in sorted(os.listdir(self.directory)):
      if TMP_MARKER in name:
        path = os.path.join(self.directory, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed

  def saving_in_progress(self) -> bool:
    """Returns whether an asynchronous save is still being written."""
    return self._manager.is_saving_in_progress()

  def wait_until_finished(self) -> None:
    """Blocks until pending asynchronous saves are committed to disk; raises
    CheckpointSaveError when one of them failed."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      step, self._pending_step = self._pending_step, None
      raise self._save_error(step, e) from e
    self._pending_step = None

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources (raises
    CheckpointSaveError, after releasing them, when a pending save failed)."""
    try:
      self.wait_until_finished()
    finally:
      self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _flat_shapes(tree: Any) -> dict:
  """Returns {"a/b/c": shape} of the arrays (anything with a shape) of `tree`."""
  return {"/".join(_key_name(k) for k in path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
          if hasattr(leaf, "shape")}


def _shape_text(shape) -> str:
  return "has no such array" if shape is None else f"shape {shape}"


@jax.jit
def _all_finite(leaves):
  """Returns a bool vector: whether each array of `leaves` is all finite."""
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  """Returns `tree` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs carrying the
  matching leaf of `shardings`, ready for `Checkpointer.restore(abstract_state=...)`."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
