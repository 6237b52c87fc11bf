"""Test helper: a digest of every file under a folder, to show nothing changed."""
import glob
import hashlib
import os


def tree_digest(directory):
  """Returns {relative path: sha256} of every file under `directory`."""
  digests = {}
  for path in sorted(glob.glob(os.path.join(directory, "**"), recursive=True)):
    if os.path.isfile(path):
      with open(path, "rb") as f:
        digests[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return digests
