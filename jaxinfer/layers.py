"""The loop over a model's layers, the weights container it walks, and what each layer is given.

A model is three stage functions (jaxinfer.models.Model): embed, one decoder layer, and the head. Its
layer weights come as `LayerStack`s: runs of consecutive layers of one kind (a dense MLP or a mixture of
experts), each weight stacked along a leading "layers" axis, so a run is one `lax.scan` and compile time
stays flat in depth. A model whose layers are all alike is one stack; Qwen3-MoE with `mlp_only_layers`
is several. This module is the one place that loops over layers; a pipeline over pp (jaxinfer.pipeline)
regroups each stack stage by stage, and every stage runs this same loop over its own slice.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.checkpoint import ParamSpec, Spec, is_spec
from jaxinfer.sharding import Axes, Layout

if TYPE_CHECKING:
    from jaxinfer.batch import StepMetadata
    from jaxinfer.kv_cache import PagedKVCache

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


UNROLL_LAYER_BYTES = 4 << 20   # on CPU, layers whose weights are larger than this are unrolled by default


def layer_bytes(weights: Weights, dtype) -> float:
    """Bytes of an average layer's weights, from the specs (every expert counted)."""
    leaves = [s for stack in weights.layers for s in jax.tree.leaves(stack.weights, is_leaf=is_spec)]
    layers = sum(stack.size for stack in weights.layers)
    return sum(math.prod(s.shape) for s in leaves) * jnp.dtype(dtype).itemsize / layers


def one_stack_per_layer(weights: Weights) -> Weights:
    """Weight specs regrouped so that every layer is a stack of its own (one array per layer and weight),
    for the unrolled layer loop (`scan_layers=False`).

    A scan reads layer i's weights by a dynamic slice of the stacked arrays, and XLA:CPU copies that slice
    before each matmul: every decode step then writes and reads the weights once more than it needs to,
    which triples a memory-bound step's traffic. Separate arrays are read in place; the price is a program
    that grows with depth, so compile time does too."""
    out = []
    for stack in weights.layers:
        ids = layer_ids(stack) or tuple(range(stack.size))
        out += [LayerStack(restack(stack.weights, (layer,)), first=stack.first + i) for i, layer in enumerate(ids)]
    return dataclasses.replace(weights, layers=tuple(out))


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


def unfuse(y: jax.Array, widths: Sequence[int], axis: int) -> list[jax.Array]:
    """The output of a matmul with a fused weight (jaxinfer.checkpoint.FusedSpec), [..., G, sum(widths), ...]
    with its G blocks at `axis`, -> one array per part, [..., G * width, ...]. Block g's columns of a part
    are column shard g of that part, so merging the blocks back needs no communication."""
    parts = jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=axis + 1)
    return [p.reshape(*p.shape[:axis], -1, *p.shape[axis + 2:]) for p in parts]


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

    def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
        return self.layout.constrain(x, axes)

    @property
    def valid(self) -> jax.Array:
        """bool [R, N]: which token slots of the step are real (the rest is bucket padding)."""
        return self.meta.token_seq >= 0

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedKVCache, layer: jax.Array,
                  inv_freq: jax.Array) -> tuple[jax.Array, PagedKVCache]:
        """RoPE on q and k, k/v written into the cache, causal attention of each token over its sequence.
        q [R, N, H, D], k and v [R, N, KV, D] -> (out [R, N, H, D], cache)."""
        from jaxinfer.attention import attention

        return attention(q, k, v, cache, layer, inv_freq, self.meta, self.layout, self.backend)

    def moe(self, x: jax.Array, router: jax.Array, gate_up: jax.Array, down: jax.Array, *,
            top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
        """Expert-parallel SwiGLU experts (jaxinfer.moe), gate and up fused: (y [R, N, E], tokens per expert [R, X])."""
        from jaxinfer.moe import moe

        return moe(x, router, gate_up, down, self.valid, top_k=top_k, normalize=normalize, layout=self.layout)


LayerFn = Callable[[Any, jax.Array, "PagedKVCache", jax.Array, StepContext], tuple[jax.Array, "PagedKVCache", Any]]


def run_layers(layer: LayerFn, stacks: tuple[LayerStack, ...], x: jax.Array, cache: PagedKVCache,
               ctx: StepContext) -> tuple[jax.Array, PagedKVCache, jax.Array | None]:
    """Every stack in order, each one scan of `layer(weights, x, cache, layer index, ctx)`. A layer returns
    (x, cache, counts or None); the counts of the layers that return them come back stacked, in slot order.
    A stage's padding slots run like any layer, but their output is discarded and their counts are zero."""
    counts = []

    @jax.jit
    def one_layer(w: Any, x: jax.Array, cache: PagedKVCache, i: jax.Array, meta: StepMetadata):
        """A layer of a one-layer stack, traced and lowered once for all such layers of its shapes (the
        unrolled loop's program then holds one copy of the layer, called from each position)."""
        return layer(w, x, cache, i, dataclasses.replace(ctx, meta=meta))

    for stack in stacks:
        def body(carry, xs):
            x, cache = carry
            w, i, real = xs
            y, cache, aux = layer(w, x, cache, i, ctx)
            if real is not None:
                y = jnp.where(real, y, x)
                aux = None if aux is None else aux * real
            return (y, cache), aux

        ids = jnp.arange(stack.first, stack.first + stack.size, dtype=jnp.int32)
        real = (jnp.asarray([[i is not None for i in s] for s in stack.stages])[ctx.stage] if stack.padded
                else None)
        if stack.size == 1 and stack.stages is None:   # no loop: the layer reads its weights where they are
            w = jax.tree.map(lambda a: a[0], stack.weights)               # (see one_stack_per_layer)
            x, cache, aux = one_layer(w, x, cache, ids[0], ctx.meta)
            aux = None if aux is None else aux[None]
        else:
            (x, cache), aux = jax.lax.scan(body, (x, cache), (stack.weights, ids, real))
        if aux is not None:
            counts.append(aux)
    return x, cache, jnp.concatenate(counts) if counts else None
