"""Compiling a server's step buckets before it takes requests, so that no request waits for the compiler.

The engine compiles one executable per bucket (jaxinfer.batch): tokens N and sequences S per replica and
page-table width P, each a power of two, and log-probabilities on or off. Every combination is hundreds of
executables (seconds each on CPU), so the warm-up compiles the ones serving hits, at every page-table width up
to `max_len` tokens (default: the context; the narrowest is batch.MIN_TABLE_WIDTH):
- decode steps: S running sequences of one token each (N = S), S = 1, 2, 4 .. max_num_seqs;
- full prefill steps: more than half the token budget (N = max_tokens_per_step), the prompt chunks of a busy
  server, which always get all max_num_seqs sequence slots (Engine.step_shape).
Greedy and sampled requests share these (sampling is data, not shape). Not covered, compiled on first use:
steps of prompt tokens within half the budget (a lone short prompt), requests asking for log-probabilities,
scoring (LLM.logits), and pipeline parallel (pp > 1), whose steps carry the microbatches in flight.

Buckets are compiled by a few threads at once: tracing holds Python's lock, but XLA compiles (and loads
cached executables) outside it, so a warm restart's loads overlap the next bucket's tracing (12 buckets of
the 125M model from a warm cache on 2 cores: 11.5 s in one thread, 7.0 s in two).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor, as_completed

from tqdm import tqdm

from jaxinfer.batch import bucket, pack, table_width
from jaxinfer.engine import Engine
from jaxinfer.scheduler import SchedulerOutput

log = logging.getLogger("jaxinfer")
THREADS = 4   # at most: each holds a bucket's program while it compiles

Shape = tuple[int, int, int, bool]   # tokens, sequences, pages per sequence (per replica); ring prefill (sp)


def powers_of_two(upto: int) -> list[int]:
    return [1 << i for i in range(upto.bit_length()) if 1 << i <= upto]


def warmup_shapes(engine: Engine, max_len: int | None = None) -> list[Shape]:
    """The buckets the warm-up compiles (see the module docstring), rounded as jaxinfer.batch rounds them."""
    sp, page_size = engine.sp, engine.config.page_size
    max_len = min(max_len or engine.cfg.context_length, engine.cfg.context_length, engine.capacity)
    tokens = lambda n: bucket(n, multiple=2 * sp if sp > 1 else 1)  # noqa: E731
    widths = sorted({table_width(p, sp) for p in powers_of_two(bucket(-(-max_len // page_size)))})
    seqs = powers_of_two(engine.max_seqs)
    steps = [(tokens(s), s, False) for s in seqs] + [(tokens(engine.max_tokens), engine.max_seqs, sp > 1)]
    return [(n, s, p, ring) for p in widths for n, s, ring in dict.fromkeys(steps)]


def warmup(engine: Engine, max_len: int | None = None, progress: bool = True) -> int:
    """Compile (without running) the buckets of warmup_shapes; returns how many were new."""
    if engine.stages > 1:
        log.info("warm-up skipped: pipeline steps (pp > 1) are compiled on first use")
        return 0
    before, idle = engine.compilations, [SchedulerOutput([])] * len(engine.schedulers)

    def compile_one(shape: Shape) -> None:
        n, s, p, ring = shape
        batch = pack(idle, engine.config.page_size, engine.pages_per_replica, (n, s, p), engine.sp)
        if ring:  # prefill under sp: fresh K/V travel the ring
            batch = batch.replace(meta=batch.meta.replace(ring=True))
        engine.runner.compile("step", batch)

    shapes = warmup_shapes(engine, max_len)
    with (ThreadPoolExecutor(min(THREADS, os.cpu_count() or 1)) as pool,
          tqdm(total=len(shapes), desc="compiling buckets", unit="bucket", disable=not progress) as bar):
        for done in as_completed([pool.submit(compile_one, shape) for shape in shapes]):
            done.result()
            bar.update()
    return engine.compilations - before
