"""launch/tpu_vm.py --dry-run prints the right gcloud commands, fanned out to all
workers."""
import pathlib
import shlex
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "launch" / "tpu_vm.py"


def _dry_run(*args):
  out = subprocess.run([sys.executable, str(SCRIPT), args[0], "--dry-run", *args[1:]],
                       capture_output=True, text=True, check=True).stdout
  return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ")]


BASE = ["--name=moe", "--zone=us-east5-a"]


@pytest.mark.parametrize("accelerator,runtime", [
    ("v3-32", "tpu-ubuntu2204-base"), ("v4-64", "tpu-ubuntu2204-base"),
    ("v5litepod-16", "v2-alpha-tpuv5-lite"), ("v5p-128", "v2-alpha-tpuv5"),
    ("v6e-64", "v2-alpha-tpuv6e")])
def test_create_uses_the_generation_runtime(accelerator, runtime):
  [command] = _dry_run("create", *BASE, f"--accelerator={accelerator}")
  assert command[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "moe"]
  assert f"--accelerator-type={accelerator}" in command
  assert f"--version={runtime}" in command and "--zone=us-east5-a" in command


def test_queued_spot_create_and_delete():
  [create] = _dry_run("create", *BASE, "--accelerator=v5p-128", "--queued", "--spot",
                      "--project=p1")
  assert create[3:6] == ["queued-resources", "create", "moe"]
  assert "--node-id=moe" in create and "--spot" in create and "--project=p1" in create
  [delete] = _dry_run("delete", *BASE, "--queued")
  assert delete[3:6] == ["queued-resources", "delete", "moe"] and "--force" in delete


def test_install_and_train_run_on_every_worker():
  commands = _dry_run("install", *BASE, "--source=/src/openmoe_jax")
  assert [c[3:5] for c in commands] == [["tpu-vm", "ssh"], ["tpu-vm", "scp"],
                                        ["tpu-vm", "ssh"]]
  assert all("--worker=all" in c for c in commands)
  assert "pip install -e '.[tpu]' -c constraints.txt" in commands[-1][-1]
  git = _dry_run("install", *BASE, "--source=https://example.com/openmoe_jax.git")
  assert "git clone https://example.com/openmoe_jax.git" in git[0][-1]
  [train] = _dry_run("train", *BASE, "--", "--gin_file=runs/quickstart.gin",
                     "--gin.MODEL_DIR=gs://b/run")
  assert "--worker=all" in train
  assert train[-1].startswith("--command=cd openmoe_jax && nohup openmoe-train "
                              "--gin_file=runs/quickstart.gin --gin.MODEL_DIR=gs://b/run")
  [logs] = _dry_run("logs", *BASE)
  assert "--worker=0" in logs and "tail -n 100 -f" in logs[-1]


def test_train_without_flags_is_an_error():
  proc = subprocess.run([sys.executable, str(SCRIPT), "train", *BASE, "--dry-run"],
                        capture_output=True, text=True)
  assert proc.returncode != 0 and "after `--`" in proc.stderr


def test_train_flags_reach_the_remote_shell_as_given():
  # The remote command runs in a shell on each worker: a gin string with spaces or
  # quotes must arrive as the one argument the user typed.
  flags = ["--gin_file=runs/quickstart.gin", "--gin.MODEL_DIR='gs://b/run 1'",
           '--gin.train.note="a b; c"']
  [train] = _dry_run("train", *BASE, "--", *flags)
  remote = shlex.split(train[-1].removeprefix("--command="))
  start = remote.index("openmoe-train") + 1
  assert remote[start:start + len(flags)] == flags
  assert remote[start + len(flags):] == [">", "train.log", "2>&1", "&"]
