"""The device program: a model's weights and KV pool on the mesh, and the step that runs them.

One jitted function per kind of step, compiled ahead of time once per bucket shape and kept:
- "step": embed, every layer (writing K/V into the donated pool), the head on each sequence's last token,
  padded vocabulary rows masked, then one token sampled per sequence on device;
- "score": the same forward with float32 logits of every token (LLM.logits), nothing sampled.
The latest executable of each phase is kept for the collective report. The runner's `state` is what
each step donates and gets back: here the KV pool; a pipeline over pp (jaxinfer.pipeline) adds the
activations in flight between its stages.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.batch import StepBatch
from jaxinfer.distributed import to_host
from jaxinfer.kv_cache import PagedKVCache
from jaxinfer.layers import StepContext, Weights, run_layers
from jaxinfer.models import Model
from jaxinfer.sampling import sample
from jaxinfer.sharding import Layout


def _global_array(x: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array | np.ndarray:
    """A host array (identical on every process) placed as the compiled step expects it; an input the
    step does not use (no sharding: the scoring step samples nothing) is passed as it is."""
    return x if sharding is None else jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


class ModelRunner:
    """Runs steps of one model on one mesh; owns the weights, the KV pool and the compiled executables."""

    def __init__(self, model: Model, layout: Layout, weights: Weights, cache: PagedKVCache, backend: str):
        self.model, self.layout, self.weights, self.backend = model, layout, weights, backend
        self.state: Any = cache
        self.vocab_size = model.cfg.vocab_size
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        self.last: dict[str, jax.stages.Compiled] = {}   # phase -> its latest executable
        self.compile_seconds = 0.0
        self._jitted = {"step": jax.jit(self._step, donate_argnums=(1,)),
                        "score": jax.jit(self._score, donate_argnums=(1,))}

    @property
    def compilations(self) -> int:
        return len(self.executables)

    @property
    def cache(self) -> PagedKVCache:
        return self.state

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
        last = jnp.take_along_axis(x, logits_index[..., None], axis=1)               # per-row gather
        logits = self._real_vocab(self.model.head(head, last, ctx))                 # [R, S, V]
        R, S, V = logits.shape
        chex.assert_shape(last, (R, S, x.shape[-1]))
        chex.assert_type(logits, jnp.float32)
        logits = ctx.constrain(logits, ("batch", None, "vocab"))  # pinned: gather logits, not weights
        logits = ctx.constrain(logits, ("batch", None, None)).reshape(R * S, V)
        tokens, logprobs = sample(logits, sampling, sample_positions)
        return tokens.reshape(R, S), logprobs.reshape(R, S, -1)

    def _logits(self, head: Any, x: jax.Array, ctx: StepContext) -> jax.Array:
        """float32 logits [R, N, V] of every token."""
        logits = ctx.constrain(self.model.head(head, x, ctx), ("batch", "seq", "vocab"))
        return ctx.constrain(logits, ("batch", "seq", None))[..., : self.vocab_size]

    def _step(self, weights: Weights, cache: PagedKVCache, batch: StepBatch):
        x, cache, counts, ctx = self._forward(weights, cache, batch)
        tokens, logprobs = self._sample(weights.head, x, batch.logits_index, batch.sample_positions,
                                        batch.sampling, ctx)
        return (tokens, logprobs, counts), cache

    def _score(self, weights: Weights, cache: PagedKVCache, batch: StepBatch):
        x, cache, _, ctx = self._forward(weights, cache, batch)
        return self._logits(weights.head, x, ctx), cache

    def _real_vocab(self, logits: jax.Array) -> jax.Array:
        """Rows added to pad the vocabulary to a multiple of tp can never be sampled."""
        padded = logits.shape[-1]
        if padded == self.vocab_size:
            return logits
        return jnp.where(jnp.arange(padded) < self.vocab_size, logits, -jnp.inf)

    # ---- host -----------------------------------------------------------------------------------
    def run(self, kind: str, batch: StepBatch, phase: str | None = None) -> Any:
        """Compile ahead of time once per bucket (timed apart), then execute on the donated pool; the
        outputs come back to the host. The executable is remembered as the latest of its phase."""
        leaves, tree = jax.tree.flatten((self.state, batch))   # the tree holds static flags (meta.ring)
        key = (kind, tree, *map(jax.typeof, leaves))
        if key not in self.executables:
            t0 = time.perf_counter()
            with self._tracing():
                self.executables[key] = self._jitted[kind].lower(self.weights, self.state, batch).compile()
            self.compile_seconds += time.perf_counter() - t0
        exe = self.last[phase or kind] = self.executables[key]
        batch = jax.tree.map(_global_array, batch, exe.input_shardings[0][2])  # the same on every host
        out, self.state = exe(self.weights, self.state, batch)
        return jax.tree.map(to_host, out)

    def _tracing(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def step(self, batch: StepBatch, phase: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(sampled tokens [R, S], their log-probabilities [R, S, 1 + 2K], tokens routed to each expert
        [MoE layers, R, X] or None)."""
        return self.run("step", batch, phase)

    def score(self, batch: StepBatch) -> np.ndarray:
        """float32 logits [R, N, V] of every token of the batch."""
        return self.run("score", batch)
