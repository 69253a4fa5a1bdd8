"""Compiling a server's step buckets before it takes requests, so that no request waits for the compiler.

The engine compiles one executable per bucket (jaxinfer.engine.packer): tokens N and sequences S per replica, each
a power of two, and log-probabilities on or off (page tables are one width per engine: batch.table_width).
Every combination is dozens of executables (seconds each on CPU), so the warm-up compiles the ones serving
hits:
- decode steps: S running sequences of one token each (N = S), S = 1, 2, 4 .. max_num_seqs;
- prompt steps: N = the token budget, a quarter of it, .. down to 16 (Packer.prefill_sizes), each with as
  many sequence slots as it may hold (Packer.shape): every step with prompt tokens takes one of these;
  under sp twice, with and without keys cached before the step (StepMetadata.cached).
Greedy and sampled requests share these (sampling is data, not shape). Not covered, compiled on first use:
requests asking for log-probabilities, scoring (LLM.logits), and pipeline parallel (pp > 1), whose steps
carry the microbatches in flight.

Buckets are compiled by a few threads at once: tracing holds Python's lock, but XLA compiles (and loads
cached executables, jaxinfer.device.compilation_cache) outside it (the 125M model's buckets, 11 at the
time, read back from the cache on 2 cores: 5.4 s in one thread, 3.1 s in four).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
from tqdm import tqdm

from jaxinfer.engine.core import Engine
from jaxinfer.engine.packer import token_bucket
from jaxinfer.engine.scheduler import SchedulerOutput

log = logging.getLogger("jaxinfer")
THREADS = 4   # at most: each holds a bucket's program while it compiles

Shape = tuple[int, int, bool, bool]   # tokens, sequences (per replica); ring prefill (sp); cached context


def powers_of_two(upto: int) -> list[int]:
    return [1 << i for i in range(upto.bit_length()) if 1 << i <= upto]


def warmup_shapes(engine: Engine) -> list[Shape]:
    """The buckets the warm-up compiles (see the module docstring), rounded as jaxinfer.engine.packer rounds them."""
    packer = engine.packer
    decode = [(token_bucket(s, packer.sp), s, False, True) for s in powers_of_two(packer.max_seqs)]   # no ring
    prefill = [(n, min(n, packer.max_seqs), packer.sp > 1, cached) for n in packer.prefill_sizes
               for cached in ((False, True) if packer.sp > 1 else (True,))]
    return list(dict.fromkeys([*decode, *prefill]))


def warmup(engine: Engine, progress: bool = True, stored_only: bool = False) -> int:
    """Compile (without running) the buckets of warmup_shapes; returns how many were new. stored_only: only
    read back those already compiled on this machine (jaxinfer.device.compilation_cache)."""
    if engine.stages > 1:
        log.info("warm-up skipped: pipeline steps (pp > 1) are compiled on first use")
        return 0
    before = engine.compilations
    shapes = warmup_shapes(engine)
    with (ThreadPoolExecutor(min(THREADS, os.cpu_count() or 1)) as pool,
          tqdm(total=len(shapes), desc="compiling buckets", unit="bucket", disable=not progress) as bar):
        for done in as_completed([pool.submit(compile_shape, engine, shape, stored_only) for shape in shapes]):
            done.result()
            bar.update()
    return engine.compilations - before


def compile_shape(engine: Engine, shape: Shape, stored_only: bool = False) -> jax.stages.Compiled | None:
    """The step executable of one bucket, compiled (or read back) without running it."""
    n, s, ring, cached = shape
    batch = engine.packer.pack([SchedulerOutput([])] * len(engine.schedulers), (n, s))
    if ring:  # prefill under sp: fresh K/V travel the ring
        batch = batch.replace(meta=batch.meta.replace(ring=True, cached=cached))
    return engine.runner.compile("step", batch, stored_only)
