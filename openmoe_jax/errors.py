"""The two kinds of error a program reports as one line instead of a traceback.

Imports nothing, so the command-line layer can catch them without loading jax,
orbax or tensorflow.
"""


class InputError(ValueError):
  """The input is wrong (a data file, a checkpoint that does not fit the model):
  the message names it and says what would be valid. Programs exit 2."""


class RunError(RuntimeError):
  """The run could not go on (storage failed, training diverged, every checkpoint
  damaged): the message says what happened and what is safe on disk. Programs
  exit 1."""
