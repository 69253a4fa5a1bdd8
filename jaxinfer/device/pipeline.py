"""Pipeline parallel over pp: consecutive layers per stage, and P microbatches in flight across steps.

Stages. The layers are cut into `pp` runs of consecutive layers, the first `num_layers % pp` stages taking
one more (5 layers on pp=2: 3 + 2). Each layer stack (a run of layers of one kind) is regrouped stage by
stage and padded to the stage holding most of its layers, so one array sharded over pp gives each stage
its slice; a padding slot holds zero weights, its output is discarded, and it costs one layer of weights
and of KV pages on the stages that have it. The embedding and the LM head are replicated over pp (split
over tp as usual): stage 0 embeds, the last stage computes the head and samples.

The schedule (vLLM's batch queue and SGLang's slots, inside one SPMD program). One call of the step runs
every stage once, each on the microbatch it holds: stage s works on the microbatch that entered s calls
ago. Then one `lax.ppermute` passes each stage's output activations to the next stage; they wait there,
in a donated buffer sharded over pp (the "carry"), until the next call. So each call takes in a newly
scheduled microbatch at stage 0 and returns the tokens sampled for the one leaving the last stage, and P
independently scheduled microbatches are in flight. A stage whose microbatch is empty skips its layers.
Without gaps, M microbatches take M + P - 1 calls: utilisation M / (M + P - 1), the seeds' formula
N*M / (N*M + K*(P-1)) with N = K = 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec

from jaxinfer.device.kv_cache import POOL_AXES, PagedKVCache
from jaxinfer.device.layers import ACTIVATIONS, LayerStack, StepContext, Weights, layer_ids, restack, run_layers
from jaxinfer.device.runner import Dispatched, ModelRunner
from jaxinfer.models import Model
from jaxinfer.sharding import Layout, kv_head_repeat
from jaxinfer.step import PipelineBatch, StepBatch, ring_order

CARRY_AXES = ("layers", *ACTIVATIONS)  # [stages, replicas, tokens, hidden], sharded over pp like the layers
COUNT_AXES = (None, "batch", None)      # tokens routed per MoE layer slot, replica and expert


def stage_bounds(num_layers: int, stages: int) -> list[range]:
    """The model layers of each stage: consecutive, the first num_layers % stages stages one longer."""
    base, extra = divmod(num_layers, stages)
    sizes = [base + (s < extra) for s in range(stages)]
    starts = np.cumsum([0, *sizes])
    return [range(starts[s], starts[s + 1]) for s in range(stages)]


def split_stages(weights: Weights, num_layers: int, stages: int) -> Weights:
    """A model's weight specs (ParamSpec or FusedSpec leaves) regrouped into `stages` pipeline stages."""
    if stages == 1:
        return weights
    bounds, first, out = stage_bounds(num_layers, stages), 0, []
    for stack in weights.layers:
        held = [[i for i in layer_ids(stack) if i in b] for b in bounds]
        width = max(map(len, held))
        slots = tuple(tuple(h + [None] * (width - len(h))) for h in held)
        out.append(LayerStack(restack(stack.weights, tuple(i for s in slots for i in s)), first=first, stages=slots))
        first += width
    return dataclasses.replace(weights, layers=tuple(out))


def stage_specs(model: Model, layout: Layout) -> Weights:
    """The model's weight specs as `layout` holds them: KV heads repeated for tp, the vocabulary padded to a
    multiple of its shards, fused blocks per column shard, the layers regrouped into the pipeline's stages."""
    cfg = model.cfg
    specs = model.weights(kv_repeat=kv_head_repeat(cfg, layout.axis_size("kv_heads")),
                          vocab_multiple=layout.axis_size("vocab"), column_shards=layout.axis_size("heads"))
    return split_stages(specs, cfg.num_layers, layout.axis_size("layers"))


def padding_slots(weights: Weights) -> int:
    """Layer slots over all stages that hold no layer."""
    return sum(i is None for stack in weights.layers if stack.stages for s in stack.stages for i in s)


@struct.dataclass
class PipelineState:
    cache: PagedKVCache
    carry: jax.Array    # [P, R, N, E]: the activations each stage passed on, waiting for the next stage
    sampled: jax.Array  # int32 [R, S_max] the latest call's sampled tokens, which the next call's new microbatch
                        # takes the tokens the host has not seen yet from (overlapped scheduling)


def counts_by_layer(counts: np.ndarray, stacks: tuple[LayerStack, ...], moe_layers: tuple[int, ...]) -> np.ndarray:
    """Routed-token counts [P, slots, R, X] of the stages' MoE slots -> [MoE layers, R, X] in model order
    (summed over the microbatches the stages held)."""
    order = {layer: i for i, layer in enumerate(moe_layers)}
    slots = [tuple(s[j] for s in stack.stages) for stack in stacks for j in range(stack.slots)]
    out = np.zeros((len(moe_layers), *counts.shape[2:]), counts.dtype)
    for j, per_stage in enumerate(slots):
        for s, layer in enumerate(per_stage):
            if layer is not None:
                out[order[layer]] += counts[s, j]
    return out


def _holds_only(stack: LayerStack, layers: tuple[int, ...]) -> bool:
    return {i for s in stack.stages for i in s if i is not None} <= set(layers)


class PipelineRunner(ModelRunner):
    """A ModelRunner whose step is one pipeline call (see the module docstring)."""

    def __init__(self, model: Model, layout: Layout, weights: Weights, cache: PagedKVCache, backend: str,
                 max_seqs: int = 1, executables: Path | None = None):
        super().__init__(model, layout, weights, cache, backend, max_seqs, executables)
        self.stages = layout.axis_size("layers")
        self.stage_layout = layout.stage()
        self._moe_stacks = tuple(s for s in weights.layers if _holds_only(s, model.cfg.moe_layers))
        replicas = layout.axis_size("batch")
        dtype = jax.tree.leaves(weights.embed)[0].dtype
        self.sp = layout.axis_size("seq")
        make = jax.jit(lambda: jnp.zeros((self.stages, replicas, 2 * self.sp, model.cfg.hidden_size), dtype),
                       out_shardings=layout.sharding(CARRY_AXES))
        self.state = PipelineState(cache, make(), self.state.sampled)
        self._resize = jax.jit(_resize, static_argnums=(1, 2), out_shardings=layout.sharding(CARRY_AXES))

    def fit_carry(self, tokens: int) -> None:
        """The carry resized for steps of `tokens` tokens per replica (what was in it, as far as it goes)."""
        if self.state.carry.shape[2] != tokens:
            self.state = self.state.replace(carry=self._resize(self.state.carry, tokens, self.sp))

    def _tracing(self) -> contextlib.AbstractContextManager:
        return jax.set_mesh(self.layout.mesh)  # the stage's specs are resolved against it

    def dispatch(self, kind: str, batch: Any, phase: str | None = None) -> Dispatched:
        if kind == "step":
            self.fit_carry(batch.tokens.shape[1])
        return super().dispatch(kind, batch, phase)

    def collect_step(self, step: Dispatched) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(tokens sampled for the microbatch leaving the last stage [R, S], their log-probabilities, its MoE
        counts or None, its prompt log-probabilities or None), as ModelRunner.collect_step."""
        tokens, logprobs, counts, prompt = self.collect(step)
        counts = None if counts is None else counts_by_layer(counts, self._moe_stacks, self.model.cfg.moe_layers)
        return tokens, logprobs, counts, prompt

    # ---- traced ---------------------------------------------------------------------------------
    def _layers(self, layers: tuple[LayerStack, ...], x: jax.Array, cache: PagedKVCache, ctx: StepContext,
                active: jax.Array):
        """The stage's layers, or nothing at all where its microbatch is empty. A ring step under sp holds the
        ring's collective-permutes, which every device of the program must join (XLA:CPU's rendezvous waits
        for all of them; the all-gathers and all-to-alls of a decode step's attention wait for their group
        only, and a stage's group skips together), so in a ring step an idle stage runs its layers on its
        input, writes no K/V (every slot masked) and passes its input on unchanged. Its microbatch holds no
        sequence, so its attention kernels find no token to attend and skip (C++ and Pallas); its matmuls run."""
        if self.sp > 1 and ctx.meta.ring:
            ctx = dataclasses.replace(ctx, meta=ctx.meta.replace(slots=jnp.where(active, ctx.meta.slots, -1)))
            y, cache, counts = run_layers(self.model.layer, layers, x, cache, ctx)
            return jnp.where(active, y, x), cache, None if counts is None else counts * active

        def pinned(x, cache, counts):  # both branches of a cond must agree on their results' shardings
            cache = jax.tree.map(lambda c: ctx.constrain(c, POOL_AXES), cache)
            return ctx.constrain(x, ACTIVATIONS), cache, None if counts is None else ctx.constrain(counts, COUNT_AXES)

        def work(x, cache):
            return pinned(*run_layers(self.model.layer, layers, x, cache, ctx))

        counts = jax.eval_shape(work, x, cache)[2]

        def idle(x, cache):
            return pinned(x, cache, None if counts is None else jnp.zeros(counts.shape, counts.dtype))

        return jax.lax.cond(active, work, idle, x, cache)

    @staticmethod
    def _when(pred: jax.Array, fn, axes, ctx: StepContext) -> Any:
        """fn() where pred holds, zeros elsewhere (with one sharding either way). fn returns an array (axes:
        its logical axes) or a tuple of arrays (axes: a tuple of those)."""
        many = isinstance(axes[0], tuple)
        call, each = (fn, axes) if many else ((lambda: (fn(),)), (axes,))
        pin = lambda xs: tuple(ctx.constrain(x, a) for x, a in zip(xs, each, strict=True))  # noqa: E731
        shapes = jax.eval_shape(call)
        out = jax.lax.cond(pred, lambda: pin(call()), lambda: pin(tuple(jnp.zeros(x.shape, x.dtype) for x in shapes)))
        return out if many else out[0]

    def _stages(self, fn, weights: Weights, *args, in_specs: tuple, out_specs: Any):
        """fn(layers, embed, head, *args) run per stage: pp manual, the other axes left to the compiler.
        An argument or result marked "pp" is split over the stages along its leading axis, "" is replicated."""
        over = functools.partial(jax.tree.map, lambda _: PartitionSpec("pp"))
        rep = functools.partial(jax.tree.map, lambda _: PartitionSpec())
        specs = (over(weights.layers), rep(weights.embed), rep(weights.head), *(
            over(a) if s == "pp" else rep(a) for a, s in zip(args, in_specs, strict=True)))
        outs = jax.tree.map(lambda s: PartitionSpec("pp") if s == "pp" else PartitionSpec(), out_specs)
        return jax.shard_map(fn, mesh=self.layout.mesh, axis_names={"pp"}, in_specs=specs, out_specs=outs,
                             check_vma=False)(weights.layers, weights.embed, weights.head, *args)

    def _step(self, weights: Weights, state: PipelineState, batch: PipelineBatch):
        P, last = self.stages, (batch.logits_index, batch.sample_positions, batch.sampling)
        top = batch.prompt_top

        def stage(layers, embed, head, cache, carry, tokens, meta, active, last, targets):
            s, active = jax.lax.axis_index("pp"), active[0]
            ctx = StepContext(self.stage_layout, jax.tree.map(lambda m: m[0], meta), self.backend, stage=s)
            x = jax.lax.cond(s == 0, lambda: ctx.constrain(self._embed(embed, tokens, ctx), ACTIVATIONS),
                             lambda: ctx.constrain(carry[0], ACTIVATIONS))
            x, cache, counts = self._layers(layers, x, cache, ctx, active)
            sampled = self._when((s == P - 1) & active, lambda: self._sample(head, x, *last, ctx),
                                 (("batch", None), ("batch", None, None)), ctx)
            carry = jax.lax.ppermute(x, "pp", [(i, i + 1) for i in range(P - 1)])
            # from the last stage (the others add zeros) to every device, in one all-reduce: the ids as
            # float32 (exact below 2**24) beside their log-probabilities
            tokens, logprobs = sampled
            both = jax.lax.psum(jnp.concatenate([tokens[..., None].astype(jnp.float32), logprobs], -1), "pp")
            sampled = both[..., 0].astype(jnp.int32), both[..., 1:]
            prompt = None if targets is None else jax.lax.psum(self._when(
                (s == P - 1) & active, lambda: self._prompt_logprobs(head, x, targets, top, ctx),
                ("batch", "seq", None), ctx), "pp")
            return cache, carry[None], *sampled, prompt, None if counts is None else counts[None]

        fed = jnp.take_along_axis(state.sampled, jnp.maximum(batch.feed, 0), axis=1)   # as ModelRunner._step
        new = jnp.where(batch.feed >= 0, fed, batch.tokens)
        cache, carry, tokens, logprobs, prompt, counts = self._stages(
            stage, weights, state.cache, state.carry, new, batch.meta, batch.active, last, batch.prompt_targets,
            in_specs=("pp", "pp", "", "pp", "pp", "", ""), out_specs=("pp", "pp", "", "", "", "pp"))
        sampled = self.layout.constrain(state.sampled.at[:, : tokens.shape[1]].set(tokens), ("batch", None))
        carry = self.layout.constrain(carry, CARRY_AXES)   # as the next call's program takes it, whatever its shape
        return (tokens, logprobs, counts, prompt), PipelineState(cache, carry, sampled)

    def _score(self, weights: Weights, state: PipelineState, batch: StepBatch):
        """One microbatch through every stage within one call (a fill and drain): float32 logits [R, N, V]."""
        P = self.stages

        def stage(layers, embed, head, cache, tokens, meta):
            s = jax.lax.axis_index("pp")
            ctx = StepContext(self.stage_layout, meta, self.backend, stage=s)
            x = self._when(s == 0, lambda: self._embed(embed, tokens, ctx), ACTIVATIONS, ctx)
            for i in range(P):
                x, cache, _ = self._layers(layers, x, cache, ctx, s == i)
                if i < P - 1:
                    x = jax.lax.ppermute(x, "pp", [(j, j + 1) for j in range(P - 1)])
            logits = self._when(s == P - 1, lambda: self._logits(head, x, ctx), ("batch", "seq", None), ctx)
            return cache, logits[None]

        cache, logits = self._stages(stage, weights, state.cache, batch.tokens, batch.meta,
                                     in_specs=("pp", "", ""), out_specs=("pp", "pp"))
        return logits[-1], state.replace(cache=cache)


def _resize(carry: jax.Array, tokens: int, sp: int) -> jax.Array:
    """The carry for a call of `tokens` tokens per replica: every microbatch in flight fits (their tokens
    are a prefix of the row in token order), so cutting drops only padding. Under sp the rows are in ring
    order (jaxinfer.engine.packer.ring_order), which depends on the row length: back to token order and out again."""
    have = carry.shape[2]
    carry = carry[:, :, np.argsort(ring_order(have, sp))]
    carry = carry[:, :, :tokens] if tokens <= have else jnp.pad(carry, ((0, 0), (0, 0), (0, tokens - have), (0, 0)))
    return carry[:, :, ring_order(tokens, sp)]
