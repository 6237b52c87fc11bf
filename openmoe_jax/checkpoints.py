"""Orbax checkpoints of the train state plus the data pipeline position.

Layout: `<model_dir>/checkpoints/<step>/{state,data_position}`; `state` is a standard
pytree checkpoint (restorable into any sharding), `data_position` a small JSON dict
(e.g. examples consumed) so a resumed run continues the data stream where it stopped.
"""
import os
from typing import Any

import gin
import jax
import orbax.checkpoint as ocp

_STATE = "state"
_DATA_POSITION = "data_position"


@gin.configurable(denylist=["model_dir"])
class Checkpointer:
  """Saves every `save_every_steps` steps (or when forced, or on preemption) and keeps
  the last `keep` checkpoints (keep=None keeps all).

  Saving is asynchronous: `save` returns once device arrays are copied out; call
  `wait_until_finished()` before reading a checkpoint back or exiting (`close()` does).
  """

  def __init__(self, model_dir: str, save_every_steps: int = 1000, keep: int | None = 3):
    if save_every_steps < 1:
      raise ValueError(f"save_every_steps must be >= 1, got {save_every_steps}")
    self.directory = os.path.join(os.fspath(model_dir), "checkpoints")
    # Orbax's default policy also saves the first step it sees; a run should only
    # save on multiples of save_every_steps, on preemption, and when forced.
    policy = ocp.checkpoint_managers.AnySavePolicy([
        ocp.checkpoint_managers.FixedIntervalPolicy(save_every_steps),
        ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
    ])
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policy, max_to_keep=keep, create=True)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=(_STATE, _DATA_POSITION))

  def save(self, step: int, state: Any, data_position: dict | None = None,
           force: bool = False) -> bool:
    """Saves `state` (a pytree of arrays) and `data_position` (JSON-able dict) at
    `step` if the step is due or `force`. Returns whether a save was started."""
    args = ocp.args.Composite(**{
        _STATE: ocp.args.StandardSave(state),
        _DATA_POSITION: ocp.args.JsonSave(dict(data_position or {})),
    })
    return self._manager.save(int(step), args=args, force=force)

  def latest_step(self) -> int | None:
    """Returns the newest saved step, or None when there is no checkpoint."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Returns the saved steps, oldest first."""
    return sorted(self._manager.all_steps())

  def restore(self, step: int | None = None, abstract_state: Any = None
              ) -> tuple[Any, dict]:
    """Returns (state, data_position) saved at `step` (default: the latest).

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` carrying `.sharding`
    (e.g. `jax.eval_shape` output with shardings attached); arrays are restored
    directly into those shardings, with the dtypes given there. Without it, arrays
    come back as saved, on the default device. Raises FileNotFoundError when no
    checkpoint exists.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {self.directory}")
    restored = self._manager.restore(int(step), args=ocp.args.Composite(**{
        _STATE: ocp.args.StandardRestore(abstract_state),
        _DATA_POSITION: ocp.args.JsonRestore(),
    }))
    return restored[_STATE], dict(restored[_DATA_POSITION] or {})

  def saving_in_progress(self) -> bool:
    """Returns whether an asynchronous save is still being written."""
    return self._manager.is_saving_in_progress()

  def wait_until_finished(self) -> None:
    """Blocks until pending asynchronous saves are committed to disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  """Returns `tree` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs carrying the
  matching leaf of `shardings`, ready for `Checkpointer.restore(abstract_state=...)`."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
