"""Storage faults injected for real (issue 14, items 2 and 6): damaged checkpoints
fall back to the previous complete one, partial saves are ignored and cleaned, an
unwritable MODEL_DIR and a failing save raise one clear error and lose nothing."""
import asyncio
import errno
import glob
import os
import sys
import time
import types

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_files import tree_digest
from orbax.checkpoint._src.path import atomicity

from openmoe_jax import checkpoint_handlers, checkpoints


def _state(step):
  return {"step": jnp.asarray(step, jnp.int32),
          "params": {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * step,
                     "b": jnp.full((5,), step, jnp.bfloat16)}}


def _saved(tmp_path, steps=(1, 2, 3), keep=None):
  """Returns the model dir holding checkpoints of `steps` (all written)."""
  with checkpoints.Checkpointer(tmp_path, 1, keep) as ckpt:
    for step in steps:
      assert ckpt.save(step, _state(step), {"train_batches": step})
  return tmp_path


def _assert_state_of(state, step):
  expected = _state(step)
  for key in ("w", "b"):
    np.testing.assert_array_equal(np.asarray(state["params"][key]),
                                  np.asarray(expected["params"][key]))
  assert int(state["step"]) == step


def _largest(pattern):
  return max(glob.glob(pattern), key=os.path.getsize)


def _truncate_array_data(step_dir):
  path = _largest(os.path.join(step_dir, "state", "d", "*"))
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _delete_state_metadata(step_dir):
  os.remove(os.path.join(step_dir, "state", "_METADATA"))


def _truncate_manifest(step_dir):
  path = os.path.join(step_dir, "state", "manifest.ocdbt")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _delete_array_data(step_dir):
  os.remove(_largest(os.path.join(step_dir, "state", "d", "*")))


def _delete_data_position(step_dir):
  os.remove(os.path.join(step_dir, "data_position", "metadata"))


def _empty_data_position(step_dir):
  open(os.path.join(step_dir, "data_position", "metadata"), "w").close()


# _METADATA alone is not needed when the trainer's abstract state is given; without
# one (evaluation, sampling) a missing one is damage too (the test after next).
DAMAGE = [_truncate_array_data, _delete_array_data, _truncate_manifest,
          _delete_data_position, _empty_data_position]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__.strip("_"))
def test_damaged_latest_falls_back_to_previous(tmp_path, damage):
  model_dir = _saved(tmp_path)
  damaged = os.path.join(model_dir, "checkpoints", "3")
  damage(damaged)
  messages = []
  # As the trainer passes it: shapes, dtypes and shardings, no values.
  abstract = checkpoints.abstract_with_shardings(
      jax.eval_shape(lambda: _state(0)),
      jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                   _state(0)))
  with checkpoints.Checkpointer(model_dir, 1, None, print_fn=messages.append) as ckpt:
    assert ckpt.latest_step() == 3
    state, position = ckpt.restore(abstract_state=abstract)
    _assert_state_of(state, 2)
    assert position == {"train_batches": 2} and ckpt.restored_step == 2
    assert any(damaged in m and "damaged" in m for m in messages), messages
    # Set aside (not deleted), so that step 3 can be saved again.
    assert ckpt.latest_step() == 2
    assert os.path.isdir(os.path.join(model_dir, checkpoints.DAMAGED_DIR, "3"))
    assert ckpt.save(3, _state(33), {"train_batches": 3})
    ckpt.wait_until_finished()
    state, _ = ckpt.restore()
    _assert_state_of(state, 33)


def _unraisable(raise_it):
  """Returns an unraisable-hook record of the exception `raise_it()` raises."""
  try:
    raise_it()
  except Exception as e:  # pylint: disable=broad-except
    return types.SimpleNamespace(exc_type=type(e), exc_value=e,
                                 exc_traceback=e.__traceback__, err_msg=None,
                                 object=None)
  raise AssertionError(f"{raise_it} raised nothing")


def _raise_the_same_words_elsewhere():
  raise RuntimeError("Event loop is closed")


def test_a_failed_read_drops_only_the_closed_loop_error_of_its_abandoned_reads(
    tmp_path, monkeypatch):
  """Orbax closes its event loop while TensorStore still reads the other arrays; a
  read finishing later reports "Event loop is closed" as an unraisable exception,
  after the fallback moved on. A failed read (the restore, or the metadata read of
  the shape check) installs, once, a hook that drops exactly that error (raised in
  asyncio's call_soon_threadsafe) and passes on everything else, the same words
  raised elsewhere included."""
  reported = []
  report = reported.append
  model_dir = _saved(tmp_path)
  _truncate_array_data(os.path.join(model_dir, "checkpoints", "3"))
  abstract = jax.eval_shape(lambda: _state(0))
  with checkpoints.Checkpointer(model_dir, 1, None, print_fn=lambda _: None) as ckpt:
    # The shape check's metadata read fails on this damage too (no verdict: None).
    monkeypatch.setattr(sys, "unraisablehook", report)
    assert ckpt._check_fits(3, abstract) is None  # pylint: disable=protected-access
    assert isinstance(sys.unraisablehook, checkpoint_handlers.AbandonedReadsFilter)
    monkeypatch.setattr(sys, "unraisablehook", report)
    ckpt.restore()
    assert ckpt.restored_step == 2
  hook = sys.unraisablehook
  assert isinstance(hook, checkpoint_handlers.AbandonedReadsFilter)
  assert hook.previous is report
  checkpoint_handlers.filter_abandoned_reads()
  assert sys.unraisablehook is hook  # not wrapped twice
  loop = asyncio.new_event_loop()
  loop.close()
  closed_loop = _unraisable(lambda: loop.call_soon_threadsafe(print))
  same_words = _unraisable(_raise_the_same_words_elsewhere)
  open_loop = asyncio.new_event_loop()
  open_loop.set_debug(True)  # checks the callback: a TypeError in the same function
  same_place = _unraisable(lambda: open_loop.call_soon_threadsafe(42))
  open_loop.close()
  other = _unraisable(lambda: 1 / 0)
  # The same words from asyncio's base_events.py, not from call_soon_threadsafe.
  same_file = _unraisable(loop.run_forever)
  # Another type with the same words, over the closed loop's own traceback.
  other_type = types.SimpleNamespace(**{
      **vars(closed_loop), "exc_type": ValueError,
      "exc_value": ValueError("Event loop is closed")})
  records = (closed_loop, same_words, same_place, other, same_file, other_type)
  for unraisable in records:
    hook(unraisable)
  mine = [u for u in reported if any(u is x for x in records)]
  assert mine == [same_words, same_place, other, same_file, other_type]


def test_fallback_off_stops_and_names_the_damaged_checkpoint(tmp_path):
  model_dir = _saved(tmp_path)
  damaged = os.path.join(model_dir, "checkpoints", "3")
  _truncate_array_data(damaged)
  before = tree_digest(model_dir)
  gin.parse_config("Checkpointer.restore_fallback = False")
  with checkpoints.Checkpointer(model_dir, 1, None, print_fn=lambda m: None) as ckpt:
    with pytest.raises(checkpoints.CheckpointDamagedError) as error:
      ckpt.restore()
  assert damaged in str(error.value) and "restore_fallback" in str(error.value)
  assert error.value.step == 3
  assert tree_digest(model_dir) == before  # nothing moved or written


def test_every_checkpoint_damaged_raises_never_starts_from_scratch(tmp_path):
  model_dir = _saved(tmp_path, steps=(1, 2))
  for step in (1, 2):
    _delete_state_metadata(os.path.join(model_dir, "checkpoints", str(step)))
  before = tree_digest(model_dir)
  with checkpoints.Checkpointer(model_dir, 1, None, print_fn=lambda m: None) as ckpt:
    with pytest.raises(checkpoints.CheckpointDamagedError) as error:
      ckpt.restore()
  assert [s for s, _, _ in error.value.damaged] == [2, 1]
  assert error.value.step == 1  # the last one tried
  for step in (1, 2):
    assert os.path.join(model_dir, "checkpoints", str(step)) in str(error.value)
  # Fallback was on: the advice is about the storage, not about the setting.
  assert "none of the 2 checkpoints" in str(error.value)
  assert "restore_fallback" not in str(error.value)
  assert tree_digest(model_dir) == before


def test_explicit_step_never_falls_back(tmp_path):
  model_dir = _saved(tmp_path)
  _truncate_array_data(os.path.join(model_dir, "checkpoints", "2"))
  with checkpoints.Checkpointer(model_dir, 1, None, print_fn=lambda m: None) as ckpt:
    with pytest.raises(checkpoints.CheckpointDamagedError) as error:
      ckpt.restore(2)
    assert error.value.step == 2
    assert "restore it from a backup or move it away" in str(error.value)
    assert "restore_fallback" not in str(error.value)
    _assert_state_of(ckpt.restore(3)[0], 3)


def test_a_step_damaged_twice_is_set_aside_twice_under_two_names(tmp_path):
  """Step 3 damaged, set aside, saved again and damaged again, three times: the
  copies go to damaged_checkpoints/3, 3.1 and 3.2 (all kept for inspection)."""
  model_dir = _saved(tmp_path)
  aside = os.path.join(model_dir, checkpoints.DAMAGED_DIR)
  for round_ in range(3):
    _truncate_array_data(os.path.join(model_dir, "checkpoints", "3"))
    with checkpoints.Checkpointer(model_dir, 1, None, print_fn=lambda m: None) as ckpt:
      _assert_state_of(ckpt.restore()[0], 2)
      assert ckpt.save(3, _state(3), {"train_batches": 3})
    assert sorted(os.listdir(aside)) == ["3", "3.1", "3.2"][:round_ + 1]
  with checkpoints.Checkpointer(model_dir, 1, None) as ckpt:
    _assert_state_of(ckpt.restore()[0], 3)


def test_changed_shape_is_not_taken_for_damage(tmp_path):
  model_dir = _saved(tmp_path)
  before = tree_digest(model_dir)
  abstract = {"step": _state(0)["step"],
              "params": {"w": jnp.zeros((3, 5)), "b": _state(0)["params"]["b"]}}
  with checkpoints.Checkpointer(model_dir, 1, None, print_fn=lambda m: None) as ckpt:
    with pytest.raises(ValueError, match="shape") as error:
      ckpt.restore(abstract_state=abstract)
  # A changed configuration, named as such (before Orbax reads anything), not damage.
  assert isinstance(error.value, checkpoints.CheckpointMismatchError)
  assert not isinstance(error.value, checkpoints.CheckpointDamagedError)
  assert "params/w: checkpoint shape (3, 4), model shape (3, 5)" in str(error.value)
  assert error.value.mismatches == [("params/w", (3, 4), (3, 5))]
  assert tree_digest(model_dir) == before


def test_an_added_or_removed_parameter_is_a_mismatch(tmp_path):
  """A parameter the checkpoint lacks (a new layer) or holds but the model does not
  (a removed one) is a changed configuration too: CheckpointMismatchError listing
  it with None on the side that lacks it, before Orbax reads anything."""
  model_dir = _saved(tmp_path, steps=(1,))
  before = tree_digest(model_dir)
  state = _state(0)
  added = {"step": state["step"],
           "params": dict(state["params"], extra=jnp.zeros((2,), jnp.float32))}
  removed = {"step": state["step"], "params": {"w": state["params"]["w"]}}
  with checkpoints.Checkpointer(model_dir, 1, None, print_fn=lambda m: None) as ckpt:
    with pytest.raises(checkpoints.CheckpointMismatchError) as error:
      ckpt.restore(abstract_state=jax.eval_shape(lambda: added))
    assert error.value.mismatches == [("params/extra", None, (2,))]
    assert "params/extra: checkpoint has no such array, model shape (2,)" in str(
        error.value)
    with pytest.raises(checkpoints.CheckpointMismatchError) as error:
      ckpt.restore(abstract_state=jax.eval_shape(lambda: removed))
    assert error.value.mismatches == [("params/b", (5,), None)]
  assert tree_digest(model_dir) == before


def test_a_mismatch_names_the_parameter_before_its_optimizer_moments(tmp_path):
  """The optimizer moment of a resized parameter repeats its mismatch; the
  parameter comes first in the list and in the message although
  'opt_state/...' sorts before 'params/...'."""
  state = {"opt_state": {"mu": {"w": jnp.zeros((3, 4))}},
           "params": {"w": jnp.zeros((3, 4))}}
  with checkpoints.Checkpointer(tmp_path, 1, None) as ckpt:
    assert ckpt.save(1, state, {"train_batches": 1})
  wider = {"opt_state": {"mu": {"w": jnp.zeros((3, 5))}},
           "params": {"w": jnp.zeros((3, 5))}}
  with checkpoints.Checkpointer(tmp_path, 1, None, print_fn=lambda m: None) as ckpt:
    with pytest.raises(checkpoints.CheckpointMismatchError) as error:
      ckpt.restore(abstract_state=jax.eval_shape(lambda: wider))
  assert error.value.mismatches == [("params/w", (3, 4), (3, 5)),
                                    ("opt_state/mu/w", (3, 4), (3, 5))]
  assert str(error.value).index("params/w:") < str(error.value).index("opt_state/mu/w:")


def test_a_mismatch_message_shows_three_arrays_and_counts_the_rest(tmp_path):
  """All mismatches are in `.mismatches`; the message names the first three."""
  narrow = {f"w{i}": jnp.zeros((2, 3)) for i in range(5)}
  with checkpoints.Checkpointer(tmp_path, 1, None) as ckpt:
    assert ckpt.save(1, narrow, {"train_batches": 1})
  wide = {f"w{i}": jnp.zeros((2, 4)) for i in range(5)}
  with checkpoints.Checkpointer(tmp_path, 1, None, print_fn=lambda m: None) as ckpt:
    with pytest.raises(checkpoints.CheckpointMismatchError) as error:
      ckpt.restore(abstract_state=jax.eval_shape(lambda: wide))
  assert len(error.value.mismatches) == 5
  message = str(error.value)
  assert [f"w{i}:" in message for i in range(5)] == [True] * 3 + [False] * 2
  assert "(and 2 more)" in message
  for changed, more in ((4, "(and 1 more)"), (3, None)):
    model = dict(narrow, **{f"w{i}": wide[f"w{i}"] for i in range(changed)})
    with checkpoints.Checkpointer(tmp_path, 1, None, print_fn=lambda m: None) as ckpt:
      with pytest.raises(checkpoints.CheckpointMismatchError) as error:
        ckpt.restore(abstract_state=jax.eval_shape(lambda: model))
    assert len(error.value.mismatches) == changed
    assert (more in str(error.value)) if more else "more)" not in str(error.value)


def test_partial_saves_are_ignored_then_removed(tmp_path):
  model_dir = _saved(tmp_path, steps=(1, 2))
  root = os.path.join(model_dir, "checkpoints")
  # What a process killed mid-save leaves behind (both Orbax spellings).
  for name in ("3.orbax-checkpoint-tmp", "4.orbax-checkpoint-tmp-1700000000"):
    os.makedirs(os.path.join(root, name, "state", "d"))
    with open(os.path.join(root, name, "state", "d", "half"), "wb") as f:
      f.write(b"\0" * 100)
  with checkpoints.Checkpointer(model_dir, 1, None) as ckpt:
    assert ckpt.latest_step() == 2
    _assert_state_of(ckpt.restore()[0], 2)
    removed = ckpt.remove_partial_saves()
    assert sorted(os.path.basename(p) for p in removed) == [
        "3.orbax-checkpoint-tmp", "4.orbax-checkpoint-tmp-1700000000"]
    assert sorted(os.listdir(root)) == ["1", "2"]
    assert ckpt.remove_partial_saves() == []
    assert ckpt.save(3, _state(3), {"train_batches": 3})
    assert ckpt.save(4, _state(4), {"train_batches": 4})
  with checkpoints.Checkpointer(model_dir, 1, None) as ckpt:
    assert ckpt.all_steps() == [1, 2, 3, 4]
    _assert_state_of(ckpt.restore()[0], 4)
  with checkpoints.Checkpointer(tmp_path / "gone", 1, None) as ckpt:
    os.rmdir(ckpt.directory)  # nothing saved yet; deleted by hand
    assert ckpt.remove_partial_saves() == []


# ------------------------------------------------------------- storage faults


def test_check_writable_creates_the_directories(tmp_path):
  model_dir = tmp_path / "runs" / "a"
  checkpoints.check_writable(str(model_dir))
  assert os.listdir(model_dir) == ["checkpoints"]
  assert os.listdir(model_dir / "checkpoints") == []
  checkpoints.check_writable(str(model_dir))  # a resumed run: both exist already
  assert os.listdir(model_dir) == ["checkpoints"]


def test_unwritable_model_dir_under_a_file(tmp_path):
  # Works as root too, where a chmod would not block writes.
  (tmp_path / "file").write_text("not a directory")
  for model_dir in (tmp_path / "file" / "run", tmp_path / "file"):
    with pytest.raises(checkpoints.UnwritableDirectoryError) as error:
      checkpoints.check_writable(str(model_dir))
    assert str(model_dir) in str(error.value)
    assert isinstance(error.value.__cause__, OSError)
    assert type(error.value.__cause__).__name__ in str(error.value)


def _fail_finalize(monkeypatch):
  """Makes the background commit of every save fail as a full disk would."""
  async def finalize(self, *args, **kwargs):
    del self, args, kwargs
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)


def _fail_write(monkeypatch):
  """Makes the synchronous part of every save fail as a full disk would."""
  def save(self, *args, **kwargs):
    del self, args, kwargs
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(checkpoints.ocp.CheckpointManager, "save", save)


@pytest.mark.parametrize("where", ["wait", "next_save", "close"])
def test_failed_background_save_raises_and_keeps_previous(tmp_path, monkeypatch,
                                                          where):
  model_dir = _saved(tmp_path, steps=(1, 2))
  before = tree_digest(os.path.join(model_dir, "checkpoints"))
  ckpt = checkpoints.Checkpointer(model_dir, 1, keep=2)
  _fail_finalize(monkeypatch)
  assert ckpt.save(3, _state(3), {"train_batches": 3})  # fails in the background
  with pytest.raises(checkpoints.CheckpointSaveError) as error:
    if where == "wait":
      ckpt.wait_until_finished()
    elif where == "next_save":
      ckpt.save(4, _state(4), {"train_batches": 4})
    else:
      ckpt.close()
  message = str(error.value)
  assert error.value.step == 3 and "step 3" in message
  assert os.path.join(str(model_dir), "checkpoints") in message
  assert "No space left on device" in message and "[1, 2]" in message
  monkeypatch.undo()
  assert ckpt.latest_step() == 2 and ckpt.all_steps() == [1, 2]
  after = tree_digest(os.path.join(model_dir, "checkpoints"))
  assert {k: v for k, v in after.items() if k.split(os.sep)[0] in "12"} == before
  if where != "close":
    # Storage fixed: the next save works and keep=2 prunes as usual.
    assert ckpt.save(5, _state(5), {"train_batches": 5}, force=True)
    ckpt.close()
    with checkpoints.Checkpointer(model_dir, 1, keep=2) as again:
      assert again.all_steps() == [2, 5]
      _assert_state_of(again.restore()[0], 5)


def test_a_failed_background_save_surfaces_at_the_next_save_that_is_not_due(
    tmp_path, monkeypatch):
  """A forced save that fails in the background is reported by the next call to
  `save` once the write has ended, due or not (a trainer calls save every step)."""
  model_dir = _saved(tmp_path, steps=(1, 2))
  ckpt = checkpoints.Checkpointer(model_dir, 10, keep=2)
  _fail_finalize(monkeypatch)
  assert ckpt.save(3, _state(3), {"train_batches": 3}, force=True)
  deadline = time.time() + 60
  while ckpt.saving_in_progress() and time.time() < deadline:
    time.sleep(0.05)
  assert not ckpt.saving_in_progress() and not ckpt.is_save_due(4)
  with pytest.raises(checkpoints.CheckpointSaveError) as error:
    ckpt.save(4, _state(4), {"train_batches": 4})
  assert error.value.step == 3 and "No space left on device" in str(error.value)
  monkeypatch.undo()
  assert not ckpt.save(5, _state(5), {"train_batches": 5})  # reported once
  ckpt.close()
  assert checkpoints.Checkpointer(model_dir, 10, keep=2).all_steps() == [1, 2]


@pytest.mark.parametrize("given", ["argument", "environment"])
def test_the_save_delay_hook_holds_each_save_partial_for_its_delay(
    tmp_path, monkeypatch, given):
  """The fault-injection hook the kill -9 test relies on: with a delay (the
  argument, or the environment variable when the argument is 0) a save stays a
  partial `<step>.orbax-checkpoint-tmp*` folder for that long, then commits."""
  delay = 1.0
  if given == "environment":
    monkeypatch.setenv(checkpoints.DEBUG_SAVE_DELAY_ENV, str(delay))
  root = tmp_path / "checkpoints"
  start = time.monotonic()
  with checkpoints.Checkpointer(tmp_path, 1, None, debug_save_delay_s=(
      delay if given == "argument" else 0.0)) as ckpt:
    assert ckpt.save(1, _state(1), {"train_batches": 1})
    names = os.listdir(root)
    assert "1" not in names and any(
        n.startswith("1.") and checkpoints.TMP_MARKER in n for n in names), names
    assert ckpt.saving_in_progress()
    ckpt.wait_until_finished()
    assert time.monotonic() - start >= delay
    assert os.listdir(root) == ["1"]
    _assert_state_of(ckpt.restore()[0], 1)


def test_failed_synchronous_save_raises_and_keeps_previous(tmp_path, monkeypatch):
  model_dir = _saved(tmp_path, steps=(1, 2))
  before = tree_digest(model_dir)
  with checkpoints.Checkpointer(model_dir, 1, keep=2) as ckpt:
    _fail_write(monkeypatch)
    with pytest.raises(checkpoints.CheckpointSaveError,
                       match="step 3 .* No space left on device"):
      ckpt.save(3, _state(3), {"train_batches": 3})
    monkeypatch.undo()
    assert ckpt.all_steps() == [1, 2]
  assert tree_digest(model_dir) == before


def test_a_state_holding_nan_is_never_saved(tmp_path):
  _saved(tmp_path, steps=(1,))
  before = tree_digest(tmp_path)
  bad = _state(2)
  bad["params"]["w"] = bad["params"]["w"].at[1, 2].set(jnp.inf)
  with checkpoints.Checkpointer(tmp_path, 1, None) as ckpt:
    with pytest.raises(checkpoints.NonFiniteStateError,
                       match=r"step 2: .*\['params'\]\['w'\].*steps \[1\]"):
      ckpt.save(2, bad, {"train_batches": 2})
    assert ckpt.save(3, _state(3), {"train_batches": 3})  # a finite one still saves
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "3"]
  assert {k: v for k, v in tree_digest(tmp_path).items() if k.startswith("checkpoints/1/")} == {
      k: v for k, v in before.items() if k.startswith("checkpoints/1/")}


def test_a_forced_save_of_a_state_holding_nan_is_refused_too(tmp_path):
  """A forced save (the last step, a preemption) of a step that is not due is
  checked as well: NonFiniteStateError and nothing on disk."""
  bad = _state(3)
  bad["params"]["b"] = bad["params"]["b"].at[0].set(jnp.nan)
  with checkpoints.Checkpointer(tmp_path, 10, None) as ckpt:
    assert not ckpt.is_save_due(3)
    with pytest.raises(checkpoints.NonFiniteStateError, match=r"\['params'\]\['b'\]"):
      ckpt.save(3, bad, {"train_batches": 3}, force=True)
  assert os.listdir(tmp_path / "checkpoints") == []
