"""Test helpers for files: writing one (with its folders), a digest of a folder (to
show nothing changed) and the training losses a run logged."""
import glob
import hashlib
import json
import os


def write_file(path, text):
  """Writes `text` to `path` (a pathlib.Path), making its folders first."""
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)


def tree_digest(directory):
  """Returns {relative path: sha256} of every file under `directory`."""
  digests = {}
  for path in sorted(glob.glob(os.path.join(directory, "**"), recursive=True)):
    if os.path.isfile(path):
      with open(path, "rb") as f:
        digests[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return digests


def logged_losses(model_dir):
  """Returns {step: train loss} of `model_dir`/metrics.jsonl, skipping a line cut off
  by a killed process (a run still being written or killed mid-line)."""
  losses = {}
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if "train/loss" in row:
        losses[row["step"]] = row["train/loss"]
  return losses
