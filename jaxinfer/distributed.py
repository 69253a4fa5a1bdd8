"""Multi-host jobs: every host runs the same program (JAX's multi-controller model).

Each process owns its local devices; the mesh spans all of them. The host side (scheduler, page
allocator, sampling seeds) is deterministic, so every process makes the same decisions and feeds the
same step; results that live on other hosts' devices are gathered before the host reads them.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join the job before JAX starts computing. Arguments default to JAXINFER_COORDINATOR,
    JAXINFER_NUM_PROCESSES and JAXINFER_PROCESS_ID; with none of them, a single-process run stays one."""
    coordinator = coordinator or os.environ.get("JAXINFER_COORDINATOR")
    num_processes = num_processes or int(os.environ.get("JAXINFER_NUM_PROCESSES", "1"))
    if process_id is None:
        process_id = int(os.environ.get("JAXINFER_PROCESS_ID", "0"))
    if num_processes <= 1:
        return
    if not coordinator:
        raise ValueError(f"{num_processes} processes need a coordinator address (host:port), "
                         f"e.g. --coordinator 10.0.0.1:1234 or JAXINFER_COORDINATOR")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is outside 0..{num_processes - 1}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts talk over TCP
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host, gathering the parts that live on other hosts' devices."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def shared_seed() -> int:
    """A random seed every process agrees on (process 0 draws it)."""
    seed = np.array(np.random.randint(2**31), np.int32)
    if jax.process_count() > 1:
        seed = multihost_utils.broadcast_one_to_all(seed)
    return int(seed)
