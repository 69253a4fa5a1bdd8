"""What the engine counts: step timings and token counts, and the expert load of MoE models."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0          # steps that computed at least one prompt token
    prefill_seconds: float = 0.0    # device time of those steps (compilation excluded)
    prefill_tokens: int = 0
    decode_seconds: float = 0.0     # device time of decode-only steps
    decode_tokens: int = 0
    decode_steps: int = 0
    compile_seconds: float = 0.0
    preemptions: int = 0
    stage_steps: int = 0            # pipeline stages x steps (steps, with one stage)
    busy_stage_steps: int = 0       # of those, stages that held a microbatch with work
    microbatches: int = 0           # steps that fed in new work
    # where a step's time goes (compilation excluded): host work, and the device's between dispatch and results
    schedule_seconds: float = 0.0   # host: the schedulers pick the step's work
    pack_seconds: float = 0.0       # host: the work packed into bucketed arrays
    transfer_seconds: float = 0.0   # host: the arrays packed into one buffer (placed by the step's launch in
                                    # one process; across processes, each builds its part here)
    device_seconds: float = 0.0     # host: starting steps and waiting for their outputs
    fetch_seconds: float = 0.0      # host: tokens and log-probabilities back to the host
    update_seconds: float = 0.0     # host: tokens handed out (stop checks, detokenizing, stream callbacks)
    wall_seconds: float = 0.0       # the steps' wall time (compilation excluded)
    idle_seconds: float = 0.0       # of it, the device had no step to run (overlapped: an upper bound)
    decode_host_seconds: float = 0.0   # the host work of decode-only steps (counted as decode_seconds are)
    host_cpu_seconds: float = 0.0   # the stepping thread's CPU time (compilation excluded): on a CPU backend
                                    # the host's work takes cores from the device's, overlapped or not

    @property
    def utilisation(self) -> float:
        """Stage-steps that did real work over all stage-steps (1.0 without a pipeline, when always busy)."""
        return self.busy_stage_steps / self.stage_steps if self.stage_steps else 0.0

    @property
    def host_seconds(self) -> float:
        return (self.schedule_seconds + self.pack_seconds + self.transfer_seconds + self.fetch_seconds
                + self.update_seconds)

    @property
    def device_idle(self) -> float:
        """Fraction of the steps' wall time the device waited for the host. Synchronous: whenever the host
        works. Overlapped: from the latest moment a step was seen running until the next was dispatched,
        where it had finished by then."""
        return self.idle_seconds / self.wall_seconds if self.wall_seconds else 0.0

    def dispatched(self, timing: Any, busy: list[bool], prompt_outputs: list[Any]) -> None:
        """A device call was made (timing: its StepTiming): which pipeline stages held work (busy[0]: the new
        microbatch), and its new microbatch's outputs if it had prompt tokens."""
        self.transfer_seconds += timing.transfer
        self.device_seconds += timing.launch
        self.stage_steps += len(busy)
        self.busy_stage_steps += sum(busy)
        self.microbatches += busy[0]
        self.prefill_tokens += sum(o.num_tokens for o in prompt_outputs)

    def stepped(self, t_start: float, cpu_start: float, before: tuple[float, float, float], runner: Any,
                made: Any, handed: list[Any], overlap: bool) -> None:
        """An engine step ended: it started at t_start (perf_counter, thread_time cpu_start), `before` it the
        runner's compile and compile-CPU seconds and the host seconds were these; it made the call of `made`
        (an engine InFlight, or None) and handed out the calls of `handed`."""
        compile_before, compile_cpu_before, host_before = before
        seconds = time.perf_counter() - t_start - (runner.compile_seconds - compile_before)
        self.wall_seconds += seconds
        for e in handed:
            self.device_seconds += e.call.timing.wait
            self.fetch_seconds += e.call.timing.fetch
            self.steps += 1
            if e.prefill:
                self.prefill_steps += 1
            else:
                self.decode_steps += 1
                self.decode_tokens += sum(seq.samples for o in e.work or [] for seq in o.sequences)
        if not overlap:   # the device waited for every moment the host did not wait for it
            self.idle_seconds += seconds - sum(e.call.timing.launch + e.call.timing.wait for e in handed)
        timed = handed[0] if handed else made   # overlapped, a run's first step has nothing to hand out yet
        if timed is not None:
            if timed.prefill:
                self.prefill_seconds += seconds
            else:
                self.decode_seconds += seconds
                self.decode_host_seconds += self.host_seconds - host_before
        self.compile_seconds = runner.compile_seconds
        self.host_cpu_seconds += time.thread_time() - cpu_start - (runner.compile_cpu_seconds - compile_cpu_before)

    def copy(self) -> EngineStats:
        return dataclasses.replace(self)

    def __sub__(self, before: EngineStats) -> EngineStats:
        """What happened since `before` (the counters are cumulative over the engine's life)."""
        return EngineStats(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(before),
                                                    strict=True)))


class ExpertLoad:
    """Tokens routed to each expert, per MoE layer: in the last step and since the engine started."""

    def __init__(self):
        self.last: np.ndarray | None = None     # int [moe layers, experts]
        self.total: np.ndarray | None = None

    def record(self, counts: np.ndarray) -> None:
        self.last = counts
        self.total = counts if self.total is None else self.total + counts

    @staticmethod
    def imbalance(counts: np.ndarray) -> np.ndarray:
        """max / mean tokens per expert, per layer (1.0 is perfect balance; 0 for a layer that saw no token)."""
        mean = counts.mean(axis=-1)
        return np.where(mean > 0, counts.max(axis=-1) / np.where(mean > 0, mean, 1), 0.0)

    def report(self) -> dict:
        if self.total is None:
            return {}
        return {"last_step": {"tokens_per_expert": self.last.tolist(), "imbalance": self.imbalance(self.last).tolist()},
                "total": {"tokens_per_expert": self.total.tolist(), "imbalance": self.imbalance(self.total).tolist()}}
