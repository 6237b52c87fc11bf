"""checkpoint_handlers.py on its own: the read hook after a read that succeeds, and
the state handler's other leaf types. (The failed reads and damaged checkpoints are
in test_reliability_storage.py.)"""
import sys
import types

import jax.numpy as jnp
import numpy as np

from openmoe_jax import checkpoint_handlers, checkpoints


def test_a_read_that_succeeds_puts_the_hook_back_and_installs_no_filter(monkeypatch):
  reported = []
  monkeypatch.setattr(sys, "unraisablehook", reported.append)
  with checkpoint_handlers.quiet_failed_reads():
    assert sys.unraisablehook is not reported.append  # dropped inside the block
    sys.unraisablehook(types.SimpleNamespace(exc_value=ZeroDivisionError()))
  assert sys.unraisablehook == reported.append and not reported


def test_the_state_handler_keeps_orbaxs_handlers_for_numpy_and_python_leaves(tmp_path):
  """Only jax.Array's handler is replaced; NumPy arrays and Python scalars are
  written and read back as Orbax's own handlers do."""
  tree = {"array": jnp.arange(6.0).reshape(2, 3), "numpy": np.arange(4),
          "count": 7, "rate": 0.5}
  with checkpoints.Checkpointer(tmp_path, 1, None, print_fn=lambda _: None) as ckpt:
    assert ckpt.save(1, tree)
    ckpt.wait_until_finished()
    back, _ = ckpt.restore()
  np.testing.assert_array_equal(back["array"], tree["array"])
  np.testing.assert_array_equal(back["numpy"], tree["numpy"])
  assert (back["count"], back["rate"]) == (7, 0.5)
