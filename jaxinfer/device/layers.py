"""The loop over a model's layers, the weights container it walks, and what each layer is given.

A model is three stage functions (jaxinfer.models.Model): embed, one decoder layer, and the head. Its
layer weights come as `LayerStack`s: runs of consecutive layers of one kind (a dense MLP or a mixture of
experts), each weight stacked along a leading "layers" axis, so a run is one `lax.scan` and compile time
stays flat in depth (or, one array per layer, a loop that picks each layer's projections by a switch:
`switched_layers`). A model whose layers are all alike is one stack; Qwen3-MoE with `mlp_only_layers`
is several. This module is the one place that loops over layers; a pipeline over pp (jaxinfer.device.pipeline)
regroups each stack stage by stage, and every stage runs this same loop over its own slice.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.checkpoint import ParamSpec, Spec, is_spec
from jaxinfer.device.attention import attention
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.device.matmul import model_matmul
from jaxinfer.device.moe import moe
from jaxinfer.quant import QuantArray
from jaxinfer.sharding import Axes, Layout
from jaxinfer.step import StepMetadata

ACTIVATIONS: Axes = ("batch", "seq", "embed")  # [replicas, tokens per replica, hidden]


@struct.dataclass
class LayerStack:
    """Consecutive layers of one kind: the model's layer weights, each leaf [n, ...], and where they sit.

    `first` is the KV-pool layer slot of the stack's first layer. `stages` is None on one pipeline stage
    (the stack is layers first .. first + n - 1); under pp it gives, per stage, the model layer held by each
    of the stage's slots, None where a stage holds fewer of this stack's layers than another (a padding
    slot: its output is discarded), and the leaves are [stages x slots, ...], stage-major.
    """

    weights: Any
    first: int = struct.field(pytree_node=False)
    stages: tuple[tuple[int | None, ...], ...] | None = struct.field(pytree_node=False, default=None)

    @property
    def size(self) -> int:
        """Layers in the leaves as seen here: all of them outside a stage, the stage's own inside one."""
        return jax.tree.leaves(self.weights)[0].shape[0]

    @property
    def slots(self) -> int:
        """KV-pool layer slots the stack takes on each stage."""
        return len(self.stages[0]) if self.stages is not None else self.size

    @property
    def padded(self) -> bool:
        return self.stages is not None and any(i is None for s in self.stages for i in s)


UNROLL_LAYER_BYTES = 4 << 20   # layers whose weights are larger than this are unrolled by default


def layer_bytes(weights: Weights, dtype) -> float:
    """Bytes of an average layer's weights, from the specs (every expert counted)."""
    leaves = [s for stack in weights.layers for s in jax.tree.leaves(stack.weights, is_leaf=is_spec)]
    layers = sum(stack.size for stack in weights.layers)
    return sum(math.prod(s.shape) for s in leaves) * jnp.dtype(dtype).itemsize / layers


def one_stack_per_layer(weights: Weights) -> Weights:
    """Weight specs regrouped so that every layer is a stack of its own (one array per layer and weight),
    run by `switched_layers` (`scan_layers=False`).

    A scan reads layer i's weights by a dynamic slice of the stacked arrays, and XLA (CPU and GPU alike) copies
    that slice before each matmul: every decode step then writes and reads the weights once more than it needs to,
    which triples a memory-bound step's traffic. Separate arrays are read in place; the price is a copy of
    each layer's projections in the program (attention stays one copy), so compile time grows with depth,
    slowly."""
    out = []
    for stack in weights.layers:
        ids = layer_ids(stack) or tuple(range(stack.size))
        out += [LayerStack(restack(stack.weights, (layer,)), first=stack.first + i) for i, layer in enumerate(ids)]
    return dataclasses.replace(weights, layers=tuple(out))


def stacks_as_run(weights: Weights, dtype, scan: bool | None, stages: int) -> Weights:
    """The weight specs stacked as the engine runs them: scanned (`scan` True) or one stack per layer (False);
    by default scanned, except where a layer's weights outgrow the caches, so that the scan's copy of them
    costs more than a deeper program's compile time (one_stack_per_layer, on CPU and on GPU alike). A
    pipeline always scans."""
    if scan is False and stages > 1:
        raise ValueError("scan_layers=False needs pp=1: pipeline stages hold their layers as stacks")
    if scan is None:
        scan = stages > 1 or layer_bytes(weights, dtype) < UNROLL_LAYER_BYTES
    return weights if scan else one_stack_per_layer(weights)


def layer_ids(stack: LayerStack) -> tuple[int | None, ...] | None:
    """The checkpoint layers a stack of specs holds, in order (None: all of the model's, 0..size-1)."""
    return jax.tree.leaves(stack.weights, is_leaf=is_spec)[0].layer_ids


def restack(specs: Any, ids: tuple[int | None, ...]) -> Any:
    """A stack's weight specs made to hold the checkpoint layers `ids` in order (None: a padding slot)."""
    def one(p: ParamSpec) -> ParamSpec:
        return dataclasses.replace(p, shape=(len(ids), *p.shape[1:]), layer_ids=ids)
    return jax.tree.map(lambda s: s.map_parts(one), specs, is_leaf=is_spec)


@struct.dataclass
class Weights:
    """A model's weights: its embedding, its layer stacks in order, and its head (each the model's own
    pytree). Leaves are specs (ParamSpec, FusedSpec) before loading and sharded jax.Arrays after."""

    embed: Any
    layers: tuple[LayerStack, ...]
    head: Any

    @property
    def stage_layers(self) -> int:
        """KV-pool layer slots per pipeline stage (all the layers when there is one stage)."""
        return sum(s.slots for s in self.layers)


def stacked(spec: Spec, layer_ids: tuple[int, ...]) -> Spec:
    """One layer's weight repeated over `layer_ids`, read from the checkpoint's {layer}-numbered tensors."""
    def stack(p: ParamSpec) -> ParamSpec:
        return dataclasses.replace(p, shape=(len(layer_ids), *p.shape), axes=("layers", *p.axes), layer_ids=layer_ids)
    return spec.map_parts(stack)


def stack_layers(num_layers: int, kind: Callable[[int], Hashable],
                 layer: Callable[[Any], Any]) -> tuple[LayerStack, ...]:
    """Group consecutive layers of equal `kind(i)` into stacks; `layer(kind)` gives one layer's tree of specs."""
    stacks = []
    for k, run in itertools.groupby(range(num_layers), key=kind):
        ids = tuple(run)
        specs = jax.tree.map(lambda s, ids=ids: stacked(s, ids), layer(k), is_leaf=is_spec)
        stacks.append(LayerStack(specs, first=ids[0]))
    return tuple(stacks)


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a layer uses besides its weights: the mesh layout, this step's metadata, and the attention and
    mixture-of-experts implementations. Model code calls these and never names a mesh axis."""

    layout: Layout
    meta: StepMetadata
    backend: str  # attention: "xla" (the jnp reference) or "pallas" (the kernels)
    stage: jax.Array | int = 0  # the pipeline stage running these layers
    attend: Callable | None = None  # stands in for attention (same arguments and results) where set

    def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
        return self.layout.constrain(x, axes)

    @property
    def valid(self) -> jax.Array:
        """bool [R, N]: which token slots of the step are real (the rest is bucket padding)."""
        return self.meta.token_seq >= 0

    def embed(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """The rows of a vocabulary-parallel table [V, E] for tokens [R, N] -> [R, N, E]: each vocabulary shard
        looks up the tokens it holds (zeros for the others) and one all-reduce sums them (Megatron's), spelled
        out per device because XLA's partitioning of the plain gather aborts inside a pipeline stage for steps
        of 256 tokens or more (jax 0.12)."""
        axes = self.layout.mesh_axes("vocab")

        def local(table: jax.Array, tokens: jax.Array) -> jax.Array:
            rows = table.shape[0]
            ids = tokens - (jax.lax.axis_index(axes) * rows if axes else 0)
            held = (ids >= 0) & (ids < rows)
            x = jnp.where(held[..., None], table[jnp.clip(ids, 0, rows - 1)], 0)
            return jax.lax.psum(x, axes) if axes else x

        return self.layout.shard_map(local, in_axes=(("vocab", "embed"), ACTIVATIONS[:2]), out_axes=ACTIVATIONS,
                                     check_vma=False)(table, tokens)

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedKVCache, layer: jax.Array,
                  inv_freq: jax.Array) -> tuple[jax.Array, PagedKVCache]:
        """RoPE on q and k, k/v written into the cache, causal attention of each token over its sequence.
        q [R, N, H, D], k and v [R, N, KV, D] -> (out [R, N, H, D], cache)."""
        if self.attend is not None:
            return self.attend(q, k, v, cache, layer, inv_freq)
        return attention(q, k, v, cache, layer, inv_freq, self.meta, self.layout, self.backend)

    def matmul(self, x: jax.Array, w: jax.Array | QuantArray, contract: int = 1, out_dtype=None) -> jax.Array:
        """x [R, N, *k] times a weight [*k, *out], plain or quantized (jaxinfer.quant) -> [R, N, *out] in
        `out_dtype` (default x's; float32 sums either way), by the backend's kernel where it has one
        (jaxinfer.device.matmul)."""
        return model_matmul(x, w, contract, self.layout, self.backend, out_dtype)

    def moe(self, x: jax.Array, router: jax.Array, gate_up: jax.Array | QuantArray, down: jax.Array | QuantArray, *,
            top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
        """Expert-parallel SwiGLU experts (jaxinfer.device.moe), gate and up fused:
        (y [R, N, E], tokens per expert [R, X])."""
        return moe(x, router, gate_up, down, self.valid, top_k=top_k, normalize=normalize, layout=self.layout,
                   backend=self.backend)


LayerFn = Callable[[Any, jax.Array, "PagedKVCache", jax.Array, StepContext], tuple[jax.Array, "PagedKVCache", Any]]


def run_layers(layer: LayerFn, stacks: tuple[LayerStack, ...], x: jax.Array, cache: PagedKVCache,
               ctx: StepContext) -> tuple[jax.Array, PagedKVCache, jax.Array | None]:
    """Every stack in order, each one scan of `layer(weights, x, cache, layer index, ctx)`. A layer returns
    (x, cache, counts or None); the counts of the layers that return them come back stacked, in slot order.
    A stage's padding slots run like any layer, but their output is discarded and their counts are zero.
    Runs of one-layer stacks (one_stack_per_layer) are one loop of `switched_layers`."""
    counts = []
    for run in _runs(stacks):
        if run[0].size == 1 and run[0].stages is None:
            x, cache, aux = switched_layers(layer, run, x, cache, ctx)
        else:
            (stack,) = run
            x, cache, aux = _scanned(layer, stack, x, cache, ctx)
        if aux is not None:
            counts.append(aux)
    return x, cache, jnp.concatenate(counts) if counts else None


def _runs(stacks: tuple[LayerStack, ...]) -> list[list[LayerStack]]:
    """Consecutive one-layer stacks of one weight structure together; every other stack alone."""
    def kind(stack: LayerStack):
        if stack.size != 1 or stack.stages is not None:
            return id(stack)
        return jax.tree.structure(stack.weights), tuple((a.shape, a.dtype) for a in jax.tree.leaves(stack.weights))
    return [list(run) for _, run in itertools.groupby(stacks, key=kind)]


def _scanned(layer: LayerFn, stack: LayerStack, x: jax.Array, cache: PagedKVCache, ctx: StepContext):
    def body(carry, xs):
        x, cache = carry
        w, i, real = xs
        y, cache, aux = layer(w, x, cache, i, ctx)
        if real is not None:
            y = jnp.where(real, y, x)
            aux = None if aux is None else aux * real
        return (y, cache), aux

    ids = jnp.arange(stack.first, stack.first + stack.size, dtype=jnp.int32)
    real = jnp.asarray([[i is not None for i in s] for s in stack.stages])[ctx.stage] if stack.padded else None
    (x, cache), aux = jax.lax.scan(body, (x, cache), (stack.weights, ids, real))
    return x, cache, aux


def unrolled_layers(layer: LayerFn, stacks: tuple[LayerStack, ...], x: jax.Array,
                    cache: PagedKVCache, ctx: StepContext) -> tuple[jax.Array, PagedKVCache]:
    """The plainest program of the layers, for the XLA floor (jaxinfer.bench.xla_floor): one-layer stacks
    straight-line, one after another (a stack of several scanned). Its compile time grows with depth,
    attention and all, which is why the engine runs such layers as `switched_layers` instead."""
    for stack in stacks:
        if stack.size == 1 and stack.stages is None:
            w = jax.tree.map(lambda a: a[0], stack.weights)
            x, cache, _ = layer(w, x, cache, jnp.int32(stack.first), ctx)
        else:
            x, cache, _ = _scanned(layer, stack, x, cache, ctx)
    return x, cache


class _Attending(Exception):
    """Ends the first half of a layer at its attention call, with the call's arguments."""


def switched_layers(layer: LayerFn, stacks: list[LayerStack], x: jax.Array, cache: PagedKVCache,
                    ctx: StepContext) -> tuple[jax.Array, PagedKVCache, jax.Array | None]:
    """Layers that each hold their own arrays, as one loop whose body runs layer i's projections by a
    `lax.switch` over the layers and attention once, for all of them.

    Each branch reads its layer's weights where they lie (a scan's slice of stacked weights is copied
    first on XLA:CPU, see one_stack_per_layer), while attention, whose kernels are most of a step's
    compile time on CPU, is compiled once rather than once per layer. A layer is split at its call to
    ctx.attention (which it makes exactly once): the part before it, traced up to that call, and the part
    after it, traced with the attention's output given (what precedes the call there is unused, and
    XLA drops it)."""
    weights = [jax.tree.map(lambda a: a[0], s.weights) for s in stacks]

    def before(w: Any, cache: PagedKVCache, x: jax.Array, i: jax.Array):
        def stop(*args):
            raise _Attending(args)
        try:
            layer(w, x, cache, i, dataclasses.replace(ctx, attend=stop))
        except _Attending as call:
            q, k, v, _, index, inv_freq = call.args[0]
            return q, k, v, index, inv_freq
        raise ValueError("a layer must call ctx.attention once; this one did not call it")

    def after(w: Any, cache: PagedKVCache, x: jax.Array, i: jax.Array, out: jax.Array):
        calls = []

        def give(q, k, v, cache, index, inv_freq):
            calls.append(None)
            return out, cache
        y, _, aux = layer(w, x, cache, i, dataclasses.replace(ctx, attend=give))
        if len(calls) != 1:
            raise ValueError(f"a layer must call ctx.attention once; this one called it {len(calls)} times")
        return y, aux

    def body(carry, i):
        x, cache = carry
        j = i - stacks[0].first
        # the cache is closed over, not an operand: a layer only hands it to attention, so no branch uses it
        q, k, v, index, inv_freq = jax.lax.switch(j, [functools.partial(before, w, cache) for w in weights], x, i)
        out, cache = ctx.attention(q, k, v, cache, index, inv_freq)
        x, aux = jax.lax.switch(j, [functools.partial(after, w, cache) for w in weights], x, i, out)
        return (x, cache), aux

    ids = jnp.arange(stacks[0].first, stacks[0].first + len(stacks), dtype=jnp.int32)
    (x, cache), aux = jax.lax.scan(body, (x, cache), ids)
    return x, cache, aux
