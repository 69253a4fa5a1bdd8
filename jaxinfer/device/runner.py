"""The device program: a model's weights and KV pool on the mesh, and the step that runs them.

One jitted function per kind of step, compiled ahead of time once per bucket shape and kept:
- "step": embed, every layer (writing K/V into the donated pool), the head on each sequence's last token,
  padded vocabulary rows masked, then one token sampled per sequence on device; in a step where a request
  asked for prompt log-probabilities (StepBatch.prompt_targets), also the head on every token and each
  position's log-probability of the next prompt token (`_prompt_logprobs`): a program of its own, so the
  steps nobody asks in are unchanged;
- "score": the same forward with float32 logits of every token (LLM.logits), nothing sampled.
The latest executable of each phase is kept for the collective report. The runner's `state` is what
each step donates and gets back: here the KV pool and the latest sampled tokens (which the next step
takes the tokens the host has not seen yet from: overlapped scheduling); a pipeline over pp
(jaxinfer.device.pipeline) has the activations in flight between its stages instead of the tokens.

`dispatch` starts a step and returns its outputs still on the device; `collect` waits for them and brings
them to the host. Between the two the host is free to prepare the next step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.device import quant_matmul_cpu
from jaxinfer.device.attention import cpu as cpu_attention
from jaxinfer.device.compilation_cache import (
    defined_in_jaxinfer,
    executable_key,
    jax_cache_hits,
    load_executable,
    save_executable,
    signature,
)
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.device.layers import StepContext, Weights, run_layers
from jaxinfer.distributed import to_host
from jaxinfer.models import Model
from jaxinfer.sampling import sample
from jaxinfer.sharding import Layout
from jaxinfer.step import StepBatch, prompt_logprob_width

# XLA:CPU's LLVM at -O2 rather than its default -O3: the 125M model's eight warm-up buckets compile in ~18%
# less CPU time (one at a time: 29.5-30.8 -> 23.7-25.6 s on 2 cores), its steps run as fast and give the same
# logits to the bit; what compiling costs there is a fixed price per kernel (~140 small ones a step), not
# the optimizer's work on any one of them. A level named in XLA_FLAGS is the user's choice for every program and
# wins (the test suite's 0 compiles the engine's steps in about 30% less time than 2).
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 2}


def compiler_options(platform: str) -> dict[str, Any]:
    """The XLA options the engine's programs compile with on `platform`: the backend's defaults, but on CPU
    LLVM at -O2 unless XLA_FLAGS sets the level."""
    if platform != "cpu" or "--xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return dict(CPU_COMPILER_OPTIONS)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """A step's host arrays (int32, uint32, float32, bool) as one flat int32 buffer, so they reach the devices
    in one transfer, not one per array (on CPU a transfer costs ~0.1 ms whatever its size); the step unpacks
    them with static slices and bitcasts. The layout (tree, shapes, dtypes) is static: one per bucket, like
    the executable."""

    tree: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]   # dtype objects, not names: numpy's dtype.name costs ~5 us a leaf

    @classmethod
    def pack(cls, batch: Any) -> tuple[Inputs, list[np.ndarray]]:
        leaves, tree = jax.tree.flatten(batch)
        leaves = [np.asarray(x) for x in leaves]
        words = [(x.astype(np.int32) if x.dtype == bool else x.view(np.int32)).ravel() for x in leaves]
        return cls(tree, tuple(x.shape for x in leaves), tuple(x.dtype for x in leaves)), [np.concatenate(words)]

    def unpack(self, buffers: list[jax.Array], replicated: jax.sharding.Sharding) -> Any:
        """The arrays, replicated as the buffer is (so unpacking moves nothing between devices; each consumer
        slices out its shard locally)."""
        (words,), start, leaves = buffers, 0, []
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            x = words[start: start + math.prod(shape)].reshape(shape)
            start += x.size
            x = x != 0 if dtype == np.bool_ else jax.lax.bitcast_convert_type(x, dtype)
            leaves.append(jax.lax.with_sharding_constraint(x, replicated))
        return self.tree.unflatten(leaves)


@struct.dataclass
class RunnerState:
    cache: PagedKVCache
    sampled: jax.Array   # int32 [R, S_max] the latest step's sampled tokens (row r: replica r's sequences)


@dataclasses.dataclass
class StepTiming:
    """Where the host's time went in one dispatch and its collect (seconds)."""

    transfer: float = 0.0   # packing the inputs into one buffer (and, across processes, placing it)
    launch: float = 0.0     # calling the executable (asynchronous: returns before the device is done)
    wait: float = 0.0       # waiting for the outputs to be ready
    fetch: float = 0.0      # the outputs to the host


@dataclasses.dataclass(eq=False)
class Dispatched:
    """A step started on the device: its outputs, not ready yet, and the host's time it took."""

    outputs: Any
    timing: StepTiming

    def ready(self) -> bool:
        """Whether the outputs are ready (non-blocking)."""
        return all(x.is_ready() for x in jax.tree.leaves(self.outputs))


class ModelRunner:
    """Runs steps of one model on one mesh; owns the weights, the KV pool and the compiled executables."""

    def __init__(self, model: Model, layout: Layout, weights: Weights, cache: PagedKVCache, backend: str,
                 max_seqs: int = 1, executables: Path | None = None):
        """max_seqs: the most sequences a replica's step holds (the width of the kept sampled tokens);
        executables: a directory to keep compiled steps in across processes (jaxinfer.device.compilation_cache),
        used for jaxinfer's own architectures."""
        self.model, self.layout, self.weights, self.backend = model, layout, weights, backend
        self.executables_dir = executables if defined_in_jaxinfer(type(model)) else None
        self.loaded = 0   # executables read from executables_dir instead of compiled
        replicas = layout.axis_size("batch")
        sampled = jax.ShapeDtypeStruct((replicas, max_seqs), np.int32, sharding=layout.sharding(("batch", None)))
        if not isinstance(cache.k, jax.ShapeDtypeStruct):   # an engine that compiles only holds shapes
            sampled = jax.device_put(np.zeros(sampled.shape, sampled.dtype), sampled.sharding)
        self.state: Any = RunnerState(cache, sampled)
        self.vocab_size = model.cfg.vocab_size
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        self.last: dict[str, jax.stages.Compiled] = {}   # phase -> its latest executable
        self.compile_seconds = 0.0
        self.compile_cpu_seconds = 0.0   # the compiling threads' own CPU time (tracing, lowering, XLA's work there)
        self.compiler_options = compiler_options(layout.platform)
        # every device gets the whole input buffer (a few KiB), so unpacking it needs no collective
        self._replicated = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
        self._jitted: dict[str, Callable] = {}   # bucket name -> its jitted program
        # executable -> where its input buffers go (jax works out input_shardings anew on every access: ~0.2 ms)
        self._buffer_shardings: dict[jax.stages.Compiled, list[jax.sharding.Sharding]] = {}

    def _program(self, kind: str, inputs: Inputs) -> Callable:
        """The kind's function on the unpacked inputs, jitted under its bucket's name, "<kind>_<tokens>x<slots>"
        (its HLO module is "jit_<name>", which a profile shows), the state donated, the inputs' layout static."""
        shapes = inputs.tree.unflatten(inputs.shapes)
        name = f"{kind}_{shapes.tokens[1]}x{shapes.logits_index[1]}" + "_prompt" * (shapes.prompt_targets is not None)
        if name not in self._jitted:
            fn = {"step": self._step, "score": self._score}[kind]

            def program(weights: Weights, state: RunnerState, buffers: list[jax.Array], inputs: Inputs):
                return fn(weights, state, inputs.unpack(buffers, self._replicated))

            program.__name__ = program.__qualname__ = name
            self._jitted[name] = jax.jit(program, donate_argnums=(1,), static_argnums=(3,),
                                         compiler_options=self.compiler_options)
        return self._jitted[name]

    @contextlib.contextmanager
    def compiled_with(self, **options: Any):
        """While active, steps run programs compiled anew with these XLA options added and kept nowhere (a GPU
        step profiled without CUDA graphs, whose kernels a trace cannot see inside, say); the runner's own
        executables come back after."""
        saved = self.compiler_options, self._jitted, self.executables, self.executables_dir, dict(self.last)
        self.compiler_options = {**self.compiler_options, **options}
        self._jitted, self.executables, self.executables_dir = {}, {}, None
        try:
            yield
        finally:
            self.compiler_options, self._jitted, self.executables, self.executables_dir, self.last = saved

    def state_survived(self) -> bool:
        """Whether the state (the KV pool above all) is whole: neither donated to a call that then failed nor
        the output of a computation that failed."""
        try:
            leaves = jax.tree.leaves(self.state)
            return not any(x.is_deleted() for x in leaves) and jax.block_until_ready(leaves) is not None
        except Exception:  # noqa: BLE001 - a failed computation's outputs raise its error here
            return False

    def reset_state(self) -> None:
        """A state of zeros of the same shapes and shardings, the old buffers freed first (a failed step took
        them: the engine then has every request recompute its KV from its tokens)."""
        old = jax.tree.leaves(self.state)
        specs = [(x.shape, x.dtype, x.sharding) for x in old]
        for x in old:
            if not x.is_deleted():
                x.delete()
        fresh = [jax.jit(lambda shape=shape, dtype=dtype: jnp.zeros(shape, dtype), out_shardings=sharding)()
                 for shape, dtype, sharding in specs]
        self.state = jax.tree.unflatten(jax.tree.structure(self.state), fresh)

    @property
    def compilations(self) -> int:
        return len(self.executables)

    @property
    def cache(self) -> PagedKVCache:
        return self.state.cache

    # ---- traced ---------------------------------------------------------------------------------
    def _embed(self, embed: Any, tokens: jax.Array, ctx: StepContext) -> jax.Array:
        x = self.model.embed(embed, tokens, ctx)
        chex.assert_shape(x, (*tokens.shape, self.model.cfg.hidden_size))
        return x

    def _forward(self, weights: Weights, cache: PagedKVCache, batch: StepBatch):
        ctx = StepContext(self.layout, batch.meta, self.backend)
        x, cache, counts = run_layers(self.model.layer, weights.layers, self._embed(weights.embed, batch.tokens, ctx),
                                      cache, ctx)
        return x, cache, counts, ctx

    def _sample(self, head: Any, x: jax.Array, logits_index: jax.Array, sample_positions: jax.Array,
                sampling: Any, ctx: StepContext) -> jax.Array:
        """The head on each sequence's last token of this step, then one token drawn per sequence: [R, S],
        and its log-probabilities [R, S, 1 + 2K] (jaxinfer.sampling.sample)."""
        if ctx.layout.in_stage and ctx.layout.axis_size("seq") > 1 and ctx.layout.axis_size("batch") > 1:
            # XLA's SPMD partitioner aborts on this gather inside a pipeline stage when its rows split over dp
            # (or ep) and its tokens over sp (jax 0.12): there the stage gathers its rows' tokens whole first
            x = ctx.constrain(x, ("batch", None, None))
        last = jnp.take_along_axis(x, logits_index[..., None], axis=1)               # per-row gather
        logits = self._real_vocab(self.model.head(head, last, ctx))                 # [R, S, V]
        R, S, _ = logits.shape
        chex.assert_shape(last, (R, S, x.shape[-1]))
        chex.assert_type(logits, jnp.float32)
        logits = ctx.constrain(logits, ("batch", None, "vocab"))  # pinned: move logits, not weights
        # Each tp rank then samples S / tp whole rows (one all-to-all), so no rank repeats another's filtering
        # and draw; fewer rows than ranks are sampled whole on every rank. On CPU rows that draw go one at a
        # time (jaxinfer.sampling.sample), so padding slots cost nothing.
        rows = ("batch", "drawn" if S % ctx.layout.axis_size("drawn") == 0 else None)
        row_by_row = ctx.layout.platform == "cpu"

        def local(logits, sampling, positions):
            r, s, v = logits.shape
            tokens, logprobs = sample(logits.reshape(r * s, v), jax.tree.map(lambda a: a.reshape(r * s), sampling),
                                      positions.reshape(r * s), row_by_row)
            return tokens.reshape(r, s), logprobs.reshape(r, s, -1)

        per_row = lambda a: a.reshape(R, S)  # noqa: E731
        return ctx.layout.shard_map(local, in_axes=((*rows, None), rows, rows), out_axes=(rows, (*rows, None)),
                                    check_vma=False)(logits, jax.tree.map(per_row, sampling), per_row(sample_positions))

    def _prompt_logprobs(self, head: Any, x: jax.Array, targets: jax.Array, top: int, ctx: StepContext) -> jax.Array:
        """The head on every token, and per token the log-softmax of its logits at `targets` (the next prompt
        token; -1: a position nobody asked for, whose row means nothing), that token's rank among the vocabulary
        and the `top` most likely: float32 [R, N, 2 + 2 * top] (jaxinfer.step.prompt_logprob_width), the
        model's own distribution (no temperature or filters, as vLLM's prompt logprobs). The logits stay
        split over the vocabulary (tp) and the tokens (sp): each rank reduces its slice and the ranks combine
        [R, N] sums and maxima and their `top` candidates, so no rank holds the whole [R, N, V]."""
        logits = ctx.constrain(self._real_vocab(self.model.head(head, x, ctx)), ("batch", "seq", "vocab"))
        R, N, _ = logits.shape
        axes = ctx.layout.mesh_axes("vocab")

        def local(logits, targets):
            v = logits.shape[-1]
            ids = jnp.arange(v, dtype=jnp.int32) + (jax.lax.axis_index(axes) * v if axes else 0)
            peak = _across(jax.lax.pmax, logits.max(-1), axes)
            peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
            log_norm = jnp.log(_across(jax.lax.psum, jnp.exp(logits - peak[..., None]).sum(-1), axes))
            own = _across(jax.lax.psum, jnp.where(ids == targets[..., None], logits, 0.0).sum(-1), axes)
            rank = _across(jax.lax.psum, (logits >= own[..., None]).sum(-1, dtype=jnp.int32), axes)
            out = [(own - peak - log_norm)[..., None], rank[..., None].astype(jnp.float32)]
            if top:
                values, at = jax.lax.top_k(logits, min(top, v))
                at = ids[at]
                if axes:   # every rank's candidates, then the best of them
                    values = jax.lax.all_gather(values, axes, axis=2, tiled=True)
                    at = jax.lax.all_gather(at, axes, axis=2, tiled=True)
                    values, best = jax.lax.top_k(values, top)
                    at = jnp.take_along_axis(at, best, axis=-1)
                out += [at.astype(jnp.float32), values - peak[..., None] - log_norm[..., None]]  # ids < 2**24: exact
            return jnp.concatenate(out, axis=-1)

        out = ctx.layout.shard_map(local, in_axes=(("batch", "seq", "vocab"), ("batch", "seq")),
                                   out_axes=("batch", "seq", None), check_vma=False)(logits, targets)
        chex.assert_shape(out, (R, N, prompt_logprob_width(top)))
        return out

    def _logits(self, head: Any, x: jax.Array, ctx: StepContext) -> jax.Array:
        """float32 logits [R, N, V] of every token."""
        logits = ctx.constrain(self.model.head(head, x, ctx), ("batch", "seq", "vocab"))
        return ctx.constrain(logits, ("batch", "seq", None))[..., : self.vocab_size]

    def _step(self, weights: Weights, state: RunnerState, batch: StepBatch):
        fed = jnp.take_along_axis(state.sampled, jnp.maximum(batch.feed, 0), axis=1)   # per-row gather
        batch = batch.replace(tokens=jnp.where(batch.feed >= 0, fed, batch.tokens))
        x, cache, counts, ctx = self._forward(weights, state.cache, batch)
        tokens, logprobs = self._sample(weights.head, x, batch.logits_index, batch.sample_positions,
                                        batch.sampling, ctx)
        prompt = (None if batch.prompt_targets is None else
                  self._prompt_logprobs(weights.head, x, batch.prompt_targets, batch.prompt_top, ctx))
        sampled = ctx.constrain(state.sampled.at[:, : tokens.shape[1]].set(tokens), ("batch", None))
        return (tokens, logprobs, counts, prompt), RunnerState(cache, sampled)

    def _score(self, weights: Weights, state: RunnerState, batch: StepBatch):
        x, cache, _, ctx = self._forward(weights, state.cache, batch)
        return self._logits(weights.head, x, ctx), state.replace(cache=cache)

    def _real_vocab(self, logits: jax.Array) -> jax.Array:
        """Rows added to pad the vocabulary to a multiple of tp can never be sampled."""
        padded = logits.shape[-1]
        if padded == self.vocab_size:
            return logits
        return jnp.where(jnp.arange(padded) < self.vocab_size, logits, -jnp.inf)

    # ---- host -----------------------------------------------------------------------------------
    def dispatch(self, kind: str, batch: StepBatch, phase: str | None = None) -> Dispatched:
        """Compile ahead of time once per bucket (timed apart), then start the executable on the donated
        state; returns its outputs on the device, before they are ready. The executable is remembered as
        the latest of its phase."""
        t0 = time.perf_counter()
        inputs, buffers = Inputs.pack(batch)
        packed = time.perf_counter() - t0
        exe = self.last[phase or kind] = self._executable(kind, inputs, buffers)
        t1 = time.perf_counter()
        placed = self._place(exe, buffers)
        t2 = time.perf_counter()
        out, self.state = exe(self.weights, self.state, placed)
        return Dispatched(out, StepTiming(transfer=packed + t2 - t1, launch=time.perf_counter() - t2))

    def _place(self, exe: jax.stages.Compiled, buffers: list[np.ndarray]) -> list[np.ndarray] | list[jax.Array]:
        """The buffers (identical on every process) as the executable takes them. In one process, as they are:
        its call places them where its input shardings say at next to no cost, where a device_put first took
        0.5-0.6 ms of host CPU a step on 2 busy cores. Across processes, each builds its part of every global
        array."""
        if jax.process_count() == 1:
            return buffers
        if exe not in self._buffer_shardings:
            self._buffer_shardings[exe] = exe.input_shardings[0][2]
        return [jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index])
                for x, sharding in zip(buffers, self._buffer_shardings[exe], strict=True)]

    def collect(self, step: Dispatched) -> Any:
        """Wait for a dispatched step's outputs and bring them to the host (timed in step.timing)."""
        t0 = time.perf_counter()
        jax.block_until_ready(step.outputs)
        t1 = time.perf_counter()
        out = jax.tree.map(to_host, step.outputs)
        step.timing.wait, step.timing.fetch = t1 - t0, time.perf_counter() - t1
        return out

    def run(self, kind: str, batch: StepBatch, phase: str | None = None) -> Any:
        """dispatch, then collect at once."""
        return self.collect(self.dispatch(kind, batch, phase))

    def compile(self, kind: str, batch: StepBatch, stored_only: bool = False) -> jax.stages.Compiled | None:
        """The executable of `kind` for the batch's bucket shape, compiled ahead of time on first use (timed
        apart) and kept; nothing runs, so a warm-up can compile a server's buckets before it serves.
        stored_only: read it back from executables_dir if it is there, else leave it (None)."""
        return self._executable(kind, *Inputs.pack(batch), stored_only=stored_only)

    def _executable(self, kind: str, inputs: Inputs, buffers: list[np.ndarray],
                    stored_only: bool = False) -> jax.stages.Compiled | None:
        leaves, tree = jax.tree.flatten(self.state)
        key = (kind, inputs, tree, *((x.shape, x.dtype) for x in leaves))   # inputs: the batch's tree, shapes
        if key not in self.executables:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            stored = self._stored(kind, inputs, buffers) if self.executables_dir is not None else None
            if stored is not None and self.layout.platform == "cpu":
                register_cpu_kernels()   # a step read back is not traced, and tracing registers the FFI targets
            exe = load_executable(stored, list(self.layout.mesh.devices.flat)) if stored is not None else None
            if exe is not None:
                self.loaded += 1
            elif stored_only:
                return None
            else:
                hits = jax_cache_hits()
                with self._tracing():
                    replicated = [jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=self._replicated)
                                  for b in buffers]
                    exe = self._program(kind, inputs).lower(self.weights, self.state, replicated, inputs).compile()
                if stored is not None and jax_cache_hits() == hits:   # only what XLA has just compiled
                    save_executable(stored, exe)
            self.executables[key] = exe
            self.compile_seconds += time.perf_counter() - t0
            self.compile_cpu_seconds += time.thread_time() - cpu0
        return self.executables[key]

    def _stored(self, kind: str, inputs: Inputs, buffers: list[np.ndarray]) -> Path:
        """Where the executable of this step is kept: named by everything its program depends on."""
        model = type(self.model)
        key = executable_key(type(self).__qualname__, kind, f"{model.__module__}.{model.__qualname__}",
                             self.model.cfg, self.backend, self.layout, self.layout.mesh.device_ids.tolist(),
                             inputs, [(b.shape, b.dtype.name) for b in buffers], signature(self.weights),
                             signature(self.state))
        return self.executables_dir / f"{kind}-{key}"

    def _tracing(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def step(self, batch: StepBatch, phase: str) -> Dispatched:
        """Dispatch a step; `collect_step` its outputs."""
        return self.dispatch("step", batch, phase)

    def collect_step(self, step: Dispatched) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(sampled tokens [R, S], their log-probabilities [R, S, 1 + 2K], tokens routed to each expert
        [MoE layers, R, X] or None, prompt log-probabilities [R, N, 2 + 2K] in the step's token order (under sp
        the ring's) or None where the step computed none)."""
        return self.collect(step)

    def score(self, batch: StepBatch) -> np.ndarray:
        """float32 logits [R, N, V] of every token of the batch."""
        return self.run("score", batch)


def _across(reduce: Callable, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """reduce(x, axes) over the mesh axes that split the vocabulary, x itself where nothing splits it."""
    return reduce(x, axes) if axes else x


def register_cpu_kernels() -> None:
    """The C++ kernels' FFI targets, which a CPU step may call, registered with XLA (built on first use)."""
    cpu_attention.available()
    quant_matmul_cpu.available()
