"""Relaunching on another mesh, and two real processes (issue 14, items 4 and 5).

Every run is a subprocess of TRAIN_MODULE with its own emulated CPU device count
(XLA_FLAGS), so that the mesh, the device count and the process count can change
between a run and its relaunch as they do on a pod.

Losses are compared at a relative tolerance of LOSS_RTOL where the reduction order
changes: a gradient or loss summed over 4 devices instead of 8, or by gloo's
all-reduce across processes instead of XLA's within one, adds the same float32
numbers in another order (about 1e-7 relative apart here). Where the order is the
same (the batch split the same number of ways in one process) they are equal bit
for bit.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from run_files import logged_losses

from test_reliability_train import TINY_BINDINGS, TRAIN_MODULE

from openmoe_jax import distributed, errors, trainer
from openmoe_jax.data import pipeline

LOSS_RTOL = 1e-6


def _env(devices: int, **extra) -> dict:
  """Returns the environment of a CPU run with `devices` emulated devices."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", ""))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}")
  env.update({k: str(v) for k, v in extra.items()})
  return env


def _cli(model_dir, steps, *bindings):
  return [sys.executable, "-m", TRAIN_MODULE, "--gin_file=runs/quickstart.gin",
          f"--gin.MODEL_DIR={model_dir}", f"--gin.TRAIN_STEPS={steps}",
          "--gin.train.checkpoint_every_steps=2", "--gin.train.keep_checkpoints=10"
          ] + [f"--gin.{b.replace(' ', '')}" for b in TINY_BINDINGS + list(bindings)]


def _spawn(cwd, model_dir, steps, devices, *bindings, **env):
  return subprocess.Popen(_cli(model_dir, steps, *bindings), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=str(cwd),
                          env=_env(devices, **env))


def _finish(proc, timeout=600) -> str:
  """Waits for `proc`; returns its output; fails unless it exited 0."""
  output, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, output[-4000:]
  return output


def _close(a: float, b: float) -> bool:
  return abs(a - b) <= LOSS_RTOL * abs(b)


def _steps_on_disk(model_dir) -> list:
  directory = os.path.join(model_dir, "checkpoints")
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return sorted(int(n) for n in names if n.isdigit())


# -- item 4: a different mesh or device count ------------------------------------------

@pytest.mark.slow
def test_resume_on_another_mesh_and_device_count_reshards_the_checkpoint(tmp_path):
  """Trained on 8 devices as data=4 x expert=2 and checkpointed at step 2, the run
  resumes from that checkpoint on 4 devices as data=2 x expert=2 and on 8 devices
  as data=8 (no expert axis): steps 3 and 4 give the uninterrupted run's losses."""
  reference = str(tmp_path / "reference")
  _finish(_spawn(tmp_path, reference, 4, 8, "make_mesh.data = 4",
                 "make_mesh.expert = 2"))
  expected = logged_losses(reference)
  assert sorted(expected) == [1, 2, 3, 4] and _steps_on_disk(reference) == [2, 4]

  relaunches = {"4 devices, data=2 x expert=2": (4, ("make_mesh.data = 2",
                                                     "make_mesh.expert = 2")),
                "8 devices, data=8": (8, ("make_mesh.data = 8",))}
  procs = {}
  for name, (devices, mesh) in relaunches.items():
    model_dir = str(tmp_path / name.split(",")[0].replace(" ", "_"))
    shutil.copytree(reference, model_dir)
    shutil.rmtree(os.path.join(model_dir, "checkpoints", "4"))
    procs[name] = (model_dir, _spawn(tmp_path, model_dir, 4, devices, *mesh))
  for name, (model_dir, proc) in procs.items():
    output = _finish(proc)
    assert "Resumed from step 2" in output, output[-3000:]
    mesh = "{'data': 2, 'expert': 2}" if name.startswith("4") else "{'data': 8}"
    assert f"mesh {mesh}" in output, output[-3000:]
    resumed = logged_losses(model_dir)
    assert sorted(resumed) == [1, 2, 3, 4], resumed
    if name.startswith("8"):  # the batch split 8 ways as before: the same sums
      assert resumed == expected, (name, resumed, expected)
    else:
      assert all(_close(resumed[s], expected[s]) for s in (3, 4)), (
          name, resumed, expected)


# -- item 5: two real processes ----------------------------------------------------------

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _two_processes(tmp_path, model_dir, steps, *bindings):
  """Starts the two processes (2 CPU devices each, gloo collectives) of one run."""
  address = f"localhost:{_free_port()}"
  return [_spawn(tmp_path, model_dir, steps, 2, *bindings, **{
      distributed.COORDINATOR_ADDRESS_ENV: address, distributed.NUM_PROCESSES_ENV: 2,
      distributed.PROCESS_ID_ENV: index}) for index in range(2)]


def _kill(procs) -> None:
  for proc in procs:
    if proc.poll() is None:
      proc.send_signal(signal.SIGKILL)
  for proc in procs:
    proc.wait(timeout=60)


@pytest.mark.slow
def test_two_processes_killed_and_relaunched_match_one_process(tmp_path):
  """Two processes (jax.distributed on localhost, 2 CPU devices each) each read
  their own data shard; both are SIGKILLed after the checkpoint of step 2, and
  relaunched; the losses of steps 1-6 are those of one process on 4 devices
  reading both shards (train.data_shards = 2), i.e. the same global batches."""
  steps = 6
  model_dir = str(tmp_path / "two")
  single = _spawn(tmp_path, str(tmp_path / "one"), steps, 4, "train.data_shards = 2")
  # The first launch writes every replicated array in parts, one per replica
  # however small (Orbax's default), so both processes write each checkpoint; the
  # relaunch keeps the library's default, under which process 0 writes these
  # small arrays whole.
  procs = _two_processes(tmp_path, model_dir, 1000,
                         "Checkpointer.replica_parallel_min_slice_bytes = 0")
  try:
    start = time.monotonic()
    while not _steps_on_disk(model_dir):
      for proc in procs:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
      assert time.monotonic() - start < 400, "no checkpoint was written"
      time.sleep(0.05)
  finally:
    _kill(procs)
  assert all(proc.returncode == -signal.SIGKILL for proc in procs)
  restart = max(_steps_on_disk(model_dir))
  assert restart < steps, restart
  state = os.path.join(model_dir, "checkpoints", str(restart), "state")
  assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(state))

  relaunched = _two_processes(tmp_path, model_dir, steps)
  try:
    outputs = [_finish(proc) for proc in relaunched]
  finally:
    _kill(relaunched)
  for output in outputs:
    assert f"Resumed from step {restart}" in output, output[-3000:]
  state = os.path.join(model_dir, "checkpoints", str(steps), "state")
  assert "ocdbt.process_0" in os.listdir(state)
  assert "ocdbt.process_1" not in os.listdir(state)
  _finish(single)
  two, one = logged_losses(model_dir), logged_losses(str(tmp_path / "one"))
  assert sorted(two) == sorted(one) == list(range(1, steps + 1)), (two, one)
  assert all(_close(two[s], one[s]) for s in one), (two, one)


# -- the pieces, without processes ---------------------------------------------------

def test_data_shards_split_among_processes_in_order():
  assert trainer.data_shards_of_process(None, 8, 0, 1) == ((0,), 1)
  assert trainer.data_shards_of_process(2, 8, 0, 1) == ((0, 1), 2)
  assert trainer.data_shards_of_process(None, 8, 1, 2) == ((1,), 2)
  assert trainer.data_shards_of_process(4, 8, 1, 2) == ((2, 3), 4)
  for shards, batch, count in ((3, 8, 2), (2, 6, 4), (16, 8, 1), (0, 8, 1)):
    with pytest.raises(errors.InputError, match="train.data_shards"):
      trainer.data_shards_of_process(shards, batch, 0, count)


def test_sharded_dataset_concatenates_each_shards_rows():
  kwargs = dict(sequence_length=16, shuffle=False, num_batches=2)
  both = list(pipeline.get_sharded_dataset("local_mix", batch_size=4,
                                           shard_indices=[0, 1], num_shards=2,
                                           **kwargs))
  for index in (0, 1):
    alone = list(pipeline.get_sharded_dataset("local_mix", batch_size=2,
                                              shard_indices=[index], num_shards=2,
                                              **kwargs))
    for joined, part in zip(both, alone, strict=True):
      for key, rows in part.items():
        np.testing.assert_array_equal(joined[key][2 * index:2 * index + 2], rows)
  assert not np.array_equal(both[0]["decoder_target_tokens"][:2],
                            both[0]["decoder_target_tokens"][2:])


@pytest.fixture
def initialized(monkeypatch):
  """Returns the list of jax.distributed.initialize calls' arguments (none is made)."""
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  return calls


def test_distributed_settings_incomplete_or_out_of_range_are_input_errors(
    monkeypatch, initialized):
  for name in (distributed.COORDINATOR_ADDRESS_ENV, distributed.NUM_PROCESSES_ENV,
               distributed.PROCESS_ID_ENV, "TPU_WORKER_HOSTNAMES",
               "MEGASCALE_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(name, raising=False)
  assert not distributed.maybe_initialize_distributed(None)
  monkeypatch.setenv(distributed.NUM_PROCESSES_ENV, "2")
  with pytest.raises(errors.InputError, match=distributed.COORDINATOR_ADDRESS_ENV):
    distributed.maybe_initialize_distributed(None)
  monkeypatch.setenv(distributed.COORDINATOR_ADDRESS_ENV, "localhost:1234")
  monkeypatch.setenv(distributed.PROCESS_ID_ENV, "2")
  with pytest.raises(errors.InputError, match=r"process id 2 is not in \[0, 2\)"):
    distributed.maybe_initialize_distributed(None)
  monkeypatch.setenv(distributed.PROCESS_ID_ENV, "one")
  with pytest.raises(errors.InputError, match="is not an integer"):
    distributed.maybe_initialize_distributed(None)
  assert not initialized
  # gin-style arguments win over the environment.
  assert distributed.maybe_initialize_distributed(None, process_id=1)
  assert initialized == [{"coordinator_address": "localhost:1234",
                          "num_processes": 2, "process_id": 1}]


def test_a_gin_process_id_of_zero_wins_over_the_environment(monkeypatch, initialized):
  """Process 0 (the coordinator) set in gin is not mistaken for "unset": the
  environment's process id does not replace it."""
  monkeypatch.setenv(distributed.COORDINATOR_ADDRESS_ENV, "localhost:1234")
  monkeypatch.setenv(distributed.NUM_PROCESSES_ENV, "2")
  monkeypatch.setenv(distributed.PROCESS_ID_ENV, "1")
  assert distributed.maybe_initialize_distributed(None, process_id=0)
  assert initialized == [{"coordinator_address": "localhost:1234",
                          "num_processes": 2, "process_id": 0}]
