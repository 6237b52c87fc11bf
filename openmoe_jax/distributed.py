"""Multi-process JAX: `maybe_initialize_distributed`, which `train()` calls first,
from gin or the OPENMOE_JAX_* environment variables (TPU VM slices, SLURM and other
multi-host launches)."""
import os
from typing import Optional

import gin
import jax

from openmoe_jax import errors


# Environment variables naming this process's place in a multi-process run (the gin
# arguments of `maybe_initialize_distributed` win over them).
COORDINATOR_ADDRESS_ENV = "OPENMOE_JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "OPENMOE_JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "OPENMOE_JAX_PROCESS_ID"


def _env_int(name: str) -> Optional[int]:
  """Returns the integer in environment variable `name`, None when it is unset."""
  value = os.environ.get(name, "").strip()
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise errors.InputError(f"{name}={value!r} is not an integer") from None


@gin.configurable(denylist=["enabled"])
def maybe_initialize_distributed(enabled: Optional[bool],
                                 coordinator_address: Optional[str] = None,
                                 num_processes: Optional[int] = None,
                                 process_id: Optional[int] = None) -> bool:
  """Initialises multi-process JAX (`jax.distributed.initialize`); returns whether
  it did (or had been already).

  `coordinator_address` ("host:port" of process 0), `num_processes` and
  `process_id` come from gin or, when unset there, from the environment variables
  OPENMOE_JAX_COORDINATOR_ADDRESS, OPENMOE_JAX_NUM_PROCESSES and
  OPENMOE_JAX_PROCESS_ID; left unset, JAX detects them (TPU VM slices, SLURM, ...).
  `enabled` None initialises when num_processes > 1 is given, or when the
  environment is a multi-host TPU VM slice. On CPU the processes' collectives run
  over gloo (TCP), JAX's default `jax_cpu_collectives_implementation`.
  """
  coordinator_address = coordinator_address or os.environ.get(
      COORDINATOR_ADDRESS_ENV) or None
  num_processes = num_processes if num_processes is not None else _env_int(
      NUM_PROCESSES_ENV)
  process_id = process_id if process_id is not None else _env_int(PROCESS_ID_ENV)
  if enabled is None:
    # libtpu may leave a warning sentence in this variable off-TPU: count only
    # entries that look like host names.
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",")
             if h and not any(c.isspace() for c in h)]
    enabled = ((num_processes or 1) > 1 or len(hosts) > 1
               or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ)
  if not enabled:
    return False
  if num_processes is not None and (coordinator_address is None or process_id is None):
    raise errors.InputError(
        f"{num_processes} processes but no "
        f"{'coordinator address' if coordinator_address is None else 'process id'}: "
        f"set maybe_initialize_distributed.coordinator_address and .process_id (gin) "
        f"or {COORDINATOR_ADDRESS_ENV} and {PROCESS_ID_ENV}, in every process")
  if num_processes is not None and not 0 <= process_id < num_processes:
    raise errors.InputError(f"process id {process_id} is not in [0, {num_processes})"
                            f" ({PROCESS_ID_ENV} / maybe_initialize_distributed."
                            "process_id)")
  if not jax.distributed.is_initialized():
    given = {"coordinator_address": coordinator_address,
             "num_processes": num_processes, "process_id": process_id}
    jax.distributed.initialize(**{k: v for k, v in given.items() if v is not None})
  return True
