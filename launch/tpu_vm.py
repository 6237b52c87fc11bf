#!/usr/bin/env python3
"""Create, set up, train on, watch and delete a Cloud TPU VM slice with gcloud.

Every step prints the exact gcloud command it runs; --dry-run prints without running.

  python launch/tpu_vm.py create  --name=moe --zone=us-east5-a --accelerator=v5p-128
  python launch/tpu_vm.py install --name=moe --zone=us-east5-a --source=.
  python launch/tpu_vm.py train   --name=moe --zone=us-east5-a -- \\
      --gin_file=runs/quickstart.gin --gin.MODEL_DIR=gs://bucket/run1
  python launch/tpu_vm.py logs    --name=moe --zone=us-east5-a
  python launch/tpu_vm.py delete  --name=moe --zone=us-east5-a

Commands that act on the slice run on every worker at once (`--worker=all`), which
is how a multi-host pod starts one process per host; `train()` then calls
`jax.distributed.initialize()` itself.
"""
import argparse
import shlex
import subprocess
import sys
from typing import List, Sequence

# Runtime images per TPU generation (Cloud TPU docs, "TPU software versions").
RUNTIMES = {
    "v3": "tpu-ubuntu2204-base", "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite", "v5e": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e",
}
REMOTE_DIR = "openmoe_jax"


def runtime_for(accelerator: str) -> str:
  """Returns the default runtime image for an accelerator type like 'v5p-128'."""
  generation = accelerator.split("-")[0]
  if generation not in RUNTIMES:
    raise SystemExit(f"unknown accelerator {accelerator!r}; generations: {sorted(RUNTIMES)}")
  return RUNTIMES[generation]


def _tpu(args, *rest: str) -> List[str]:
  return ["gcloud", "compute", "tpus", *rest, f"--zone={args.zone}"] + (
      [f"--project={args.project}"] if args.project else [])


def _ssh(args, command: str, worker: str = "all") -> List[str]:
  return _tpu(args, "tpu-vm", "ssh", args.name) + [f"--worker={worker}",
                                                   f"--command={command}"]


def create_commands(args) -> List[List[str]]:
  """Returns the command creating the slice (directly or as a queued resource)."""
  runtime = args.runtime or runtime_for(args.accelerator)
  extra = ["--spot"] if args.spot else []
  if args.queued:
    return [_tpu(args, "queued-resources", "create", args.name) + [
        f"--node-id={args.name}", f"--accelerator-type={args.accelerator}",
        f"--runtime-version={runtime}"] + extra]
  return [_tpu(args, "tpu-vm", "create", args.name) + [
      f"--accelerator-type={args.accelerator}", f"--version={runtime}"] + extra]


def install_commands(args) -> List[List[str]]:
  """Returns the commands putting the package on every worker and installing it."""
  if "://" in args.source or args.source.endswith(".git"):
    fetch = [_ssh(args, f"rm -rf {REMOTE_DIR} && git clone {shlex.quote(args.source)} "
                        f"{REMOTE_DIR}")]
  else:
    fetch = [_ssh(args, f"rm -rf {REMOTE_DIR}"),
             _tpu(args, "tpu-vm", "scp", "--recurse", args.source,
                  f"{args.name}:{REMOTE_DIR}") + ["--worker=all"]]
  return fetch + [_ssh(args, f"cd {REMOTE_DIR} && python3 -m pip install -e '.[tpu]' -c constraints.txt")]


def train_commands(args, train_args: Sequence[str]) -> List[List[str]]:
  """Returns the command starting openmoe-train on all workers, logging to a file."""
  flags = " ".join(shlex.quote(a) for a in train_args)
  return [_ssh(args, f"cd {REMOTE_DIR} && nohup openmoe-train {flags} "
                     "> train.log 2>&1 &")]


def logs_commands(args) -> List[List[str]]:
  """Returns the command streaming worker 0's training log."""
  return [_ssh(args, f"tail -n 100 -f {REMOTE_DIR}/train.log", worker="0")]


def delete_commands(args) -> List[List[str]]:
  """Returns the command deleting the slice (and its queued resource)."""
  if args.queued:
    return [_tpu(args, "queued-resources", "delete", args.name) + ["--force", "--quiet"]]
  return [_tpu(args, "tpu-vm", "delete", args.name) + ["--quiet"]]


def parse(argv: Sequence[str]):
  """Returns (parsed args, arguments after `--` for openmoe-train)."""
  argv = list(argv)
  train_args = argv[argv.index("--") + 1:] if "--" in argv else []
  argv = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("action", choices=["create", "install", "train", "logs", "delete"])
  parser.add_argument("--name", required=True)
  parser.add_argument("--zone", required=True)
  parser.add_argument("--project")
  parser.add_argument("--accelerator", default="v5litepod-8")
  parser.add_argument("--runtime", help="override the runtime image")
  parser.add_argument("--queued", action="store_true", help="use a queued resource")
  parser.add_argument("--spot", action="store_true")
  parser.add_argument("--source", default=".", help="local folder or git URL")
  parser.add_argument("--dry-run", action="store_true")
  return parser.parse_args(argv), train_args


def main(argv=None) -> int:
  """Runs (or with --dry-run prints) the gcloud commands of one action."""
  args, train_args = parse(sys.argv[1:] if argv is None else argv)
  if args.action == "train" and not train_args:
    raise SystemExit("train needs openmoe-train flags after `--`")
  commands = {"create": create_commands, "install": install_commands,
              "logs": logs_commands, "delete": delete_commands,
              "train": lambda a: train_commands(a, train_args)}[args.action](args)
  for command in commands:
    print("+ " + shlex.join(command), flush=True)
    if not args.dry_run:
      subprocess.run(command, check=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
