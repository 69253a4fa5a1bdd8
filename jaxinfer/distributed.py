"""Multi-host jobs: every host runs the same program (JAX's multi-controller model).

Each process owns its local devices; the mesh spans all of them. The host side (scheduler, page
allocator, sampling seeds) is deterministic, so every process makes the same decisions and feeds the
same step; results that live on other hosts' devices are gathered before the host reads them.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


@dataclasses.dataclass(frozen=True)
class Job:
    """This process's place in a multi-host job (one process: nothing to join)."""

    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0

    @classmethod
    def from_flags(cls, coordinator: str | None = None, num_processes: int | None = None,
                   process_id: int | None = None) -> Job:
        """Flags, else JAXINFER_COORDINATOR, JAXINFER_NUM_PROCESSES and JAXINFER_PROCESS_ID; checked here,
        before JAX starts."""
        env = os.environ
        coordinator = coordinator or env.get("JAXINFER_COORDINATOR")
        num_processes = _integer("number of processes", num_processes, env.get("JAXINFER_NUM_PROCESSES"), 1)
        process_id = _integer("process id", process_id, env.get("JAXINFER_PROCESS_ID"), 0)
        if num_processes < 1:
            raise ValueError(f"the number of processes must be at least 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process id {process_id} is outside 0..{num_processes - 1}")
        if num_processes > 1 and not coordinator:
            raise ValueError(f"{num_processes} processes need a coordinator address (host:port), "
                             f"e.g. --coordinator 10.0.0.1:1234 or JAXINFER_COORDINATOR")
        return cls(coordinator, num_processes, process_id)

    def initialize(self) -> None:
        """Join the job before JAX starts computing; a single process stays one."""
        if self.num_processes == 1:
            return
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts talk over TCP
        jax.distributed.initialize(self.coordinator, num_processes=self.num_processes, process_id=self.process_id)
        if self.process_id == 0:
            _stop_service_last()


class _LingeringService:
    """The coordination service, stopped `grace_s` after it is asked to stop."""

    def __init__(self, service: Any, grace_s: float) -> None:
        self.service, self.grace_s = service, grace_s

    def shutdown(self) -> None:
        time.sleep(self.grace_s)
        self.service.shutdown()


def _stop_service_last(grace_s: float = 1.0) -> None:
    """Process 0 hosts the job's coordination service, and JAX's exit handler destroys its gRPC server the moment
    the shutdown barrier passes. RPCs still settling then (the clients' cancelled error polls, a last heartbeat)
    can abort process 0 in gRPC (`Check failed: queue.Pop() == nullptr`) after the job's work is done. So the
    service outlives the barrier by `grace_s`."""
    from jax._src import distributed as jax_distributed  # the service has no public handle

    state = jax_distributed.global_state
    if state.service is not None and not isinstance(state.service, _LingeringService):
        state.service = _LingeringService(state.service, grace_s)


def _integer(what: str, flag: int | None, env: str | None, default: int) -> int:
    if flag is not None:
        return flag
    if env is None:
        return default
    try:
        return int(env)
    except ValueError:
        raise ValueError(f"the {what} {env!r} from the environment is not an integer") from None


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


def broadcast_object(obj: Any) -> Any:
    """Process 0's picklable `obj` on every process (others pass anything). Sizes are padded to powers of
    two, so the broadcast compiles once per size class, not once per message."""
    if jax.process_count() == 1:
        return obj
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.array(data.size, np.int32)))
    buffer = np.zeros(max(1024, 1 << (size - 1).bit_length()), np.uint8)
    buffer[: data.size] = data
    buffer = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return pickle.loads(buffer[:size].tobytes())
