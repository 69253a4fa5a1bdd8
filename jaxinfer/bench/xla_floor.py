"""The XLA floor of a decode step: the engine's weights through a plain jitted forward of the same shapes.

One token for each of the batch's sequences per call (embedding, every layer's projections, norms and MLP,
the head on every token, the argmax fed back on the device), with no engine, no host work between calls,
no KV cache and no attention (each layer's attention returns its queries). It is what the matmuls cost on
this backend: an engine's decode step can only add to it (attention, sampling, host work), so
engine tok/s / floor tok/s is the engine's efficiency.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.device.layers import StepContext, unrolled_layers
from jaxinfer.device.runner import compiler_options
from jaxinfer.engine.core import Engine
from jaxinfer.engine.packer import GREEDY, bucket_shape
from jaxinfer.engine.scheduler import ScheduledSequence, SchedulerOutput
from jaxinfer.sampling import argmax


def queries_only(q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedKVCache, layer: jax.Array,
                 inv_freq: jax.Array) -> tuple[jax.Array, PagedKVCache]:
    """Attention that returns its queries and leaves the cache alone: a layer's matmuls without attention."""
    return q, cache


def decode_floor(engine: Engine, batch: int, steps: int = 32) -> Callable[[], float] | None:
    """A timer of the floor for `batch` sequences (spread over the replicas as the schedulers spread them):
    each call times `steps` calls of the plain forward and returns decode tokens/s. Compiled here, so a
    caller can interleave its timings with the engine's. None under a pipeline (pp > 1), whose weights are
    laid out per stage."""
    if engine.stages > 1:
        return None
    runner, replicas = engine.runner, len(engine.schedulers)
    per = -(-batch // replicas)
    seqs = [ScheduledSequence(str(i), [0], 0, [0], GREEDY, 0, samples=True, prefill=False) for i in range(per)]
    outputs = [SchedulerOutput(seqs)] * replicas
    meta = engine.packer.pack(outputs, bucket_shape(outputs, engine.sp)).meta
    replicated = jax.sharding.NamedSharding(engine.layout.mesh, jax.sharding.PartitionSpec())
    meta, tokens = jax.device_put((meta, np.zeros((replicas, per), np.int32)), replicated)

    @functools.partial(jax.jit, compiler_options=compiler_options(engine.layout.platform))   # as the engine's
    def forward(weights, cache, tokens, meta):
        ctx = StepContext(engine.layout, meta, runner.backend, attend=queries_only)
        x = runner.model.embed(weights.embed, tokens, ctx)
        cache = jax.tree.map(lambda pool: pool[:, :, :0], cache)   # unread here; a full pool carried through
        x, _ = unrolled_layers(runner.model.layer, weights.layers, x, cache, ctx)
        return argmax(runner.model.head(weights.head, x, ctx))

    out = forward(runner.weights, runner.cache, tokens, meta)
    forward(runner.weights, runner.cache, out, meta).block_until_ready()   # compiled for the fed-back tokens too

    def time_it() -> float:
        t0, out = time.perf_counter(), tokens
        for _ in range(steps):
            out = forward(runner.weights, runner.cache, out, meta)
        out.block_until_ready()
        return batch * steps / (time.perf_counter() - t0)
    return time_it
