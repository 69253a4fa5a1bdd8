"""The device steps (jitted, fixed bucketed shapes, cache donated) and the host loop that drives them.

Buckets, so that neither the prompt length nor the token index causes a compilation:
- batch: the number of prompts rounded up to a power of two (and to a multiple of dp);
- prompt: the longest prompt rounded up to a power of two, at least 16;
- cache: prompt + max_tokens rounded up to a power of two, at least 128, capped at the context length.
Prefill compiles once per (batch, prompt, cache) bucket, decode once per (batch, cache) bucket.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KVCache
from jaxinfer.sampling import SamplingArrays, SamplingParams, sample
from jaxinfer.sharding import Layout
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestError(ValueError):
    """A request that cannot be served: the message names the value and the limit."""


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str          # "stop" (EOS, stop token or stop string) or "length"
    prompt_token_ids: list[int]


@dataclasses.dataclass
class StepStats:
    """Timings of the last generate call, for the launcher and the benchmark."""

    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    batch: int = 0
    cache_length: int = 0
    compile_seconds: float = 0.0


def bucket(n: int, minimum: int = 1, multiple: int = 1) -> int:
    size = max(minimum, 1 << (max(n, 1) - 1).bit_length())
    return -(-size // multiple) * multiple


class Engine:
    """Owns the sharded weights and the compiled steps of one model on one mesh."""

    def __init__(self, model, cfg: ModelConfig, layout: Layout, params: dict, dtype, kv_heads: int):
        self.model, self.cfg, self.layout, self.params = model, cfg, layout, params
        self.dtype, self.kv_heads = dtype, kv_heads
        self.stats = StepStats()
        self.executables: dict[tuple, jax.stages.Compiled] = {}  # one per step and bucket
        self.last: dict[str, jax.stages.Compiled] = {}            # the latest executable of each step
        self._jitted = {"prefill": jax.jit(self._prefill, donate_argnums=(1,)),
                        "decode": jax.jit(self._decode, donate_argnums=(1,)),
                        "logits": jax.jit(self._logits)}

    @property
    def compilations(self) -> int:
        return len(self.executables)

    def run(self, step: str, *args):
        """Compile ahead of time once per bucket (timed apart from execution), then execute."""
        key = (step, *(jax.typeof(x) for x in jax.tree.leaves(args[1:])))
        if key not in self.executables:
            t0 = time.perf_counter()
            self.executables[key] = self._jitted[step].lower(self.params, *args).compile()
            self.stats.compile_seconds += time.perf_counter() - t0
        self.last[step] = self.executables[key]
        return self.executables[key](self.params, *args)

    # ---- device: pure functions of fixed shapes -------------------------------------------------
    def _prefill(self, params, cache, tokens, positions, last, sampling):
        h, cache = self.model.forward(params, tokens, positions, cache, self.cfg, self.layout)
        at_last = lambda x: jnp.take_along_axis(x, last.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]  # noqa: E731
        logits = self.model.lm_head(params, at_last(h))                 # a per-row gather: no cross-row traffic
        return self._sample(logits, sampling, at_last(positions) + 1), cache

    def _decode(self, params, cache, tokens, positions, sampling):
        h, cache = self.model.forward(params, tokens[:, None], positions[:, None], cache, self.cfg, self.layout)
        logits = self.model.lm_head(params, h[:, 0])
        return self._sample(logits, sampling, positions + 1), cache

    def _sample(self, logits, sampling, positions):
        # One all-gather of the vocabulary-parallel logits, then every device samples the same rows
        # (a sort over a sharded vocabulary would cost several collectives).
        logits = self.layout.constrain(logits, ("batch", "vocab"))   # pinned, so XLA gathers logits, not weights
        return sample(self.layout.constrain(logits, ("batch", None)), sampling, positions)

    def _logits(self, params, tokens):
        B, T = tokens.shape
        cache = KVCache(*(jnp.zeros((self.cfg.num_layers, B, T, self.kv_heads, self.cfg.head_dim), self.dtype),) * 2)
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        h, _ = self.model.forward(params, tokens, positions, cache, self.cfg, self.layout)
        return self.model.lm_head(params, h)

    # ---- host ---------------------------------------------------------------------------------
    def new_cache(self, batch: int, length: int) -> KVCache:
        return KVCache.zeros(self.cfg.num_layers, batch, length, self.kv_heads, self.cfg.head_dim, self.dtype,
                             self.layout)

    def check_prompt(self, ids: list[int]) -> None:
        limit = self.cfg.context_length
        if not ids:
            raise RequestError("empty prompt: give at least one token")
        if len(ids) >= limit:
            raise RequestError(f"prompt of {len(ids)} tokens does not fit the context limit of {limit} tokens "
                               f"(it needs at least one free position to generate); shorten it")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary of {self.cfg.vocab_size}")

    def batch_shape(self, n: int) -> int:
        return bucket(n, multiple=self.layout.mesh.shape["dp"])

    def logits(self, sequences: list[list[int]]) -> list[np.ndarray]:
        for ids in sequences:
            self.check_prompt(ids)
        B, T = self.batch_shape(len(sequences)), bucket(max(map(len, sequences)), 16)
        tokens = np.zeros((B, T), np.int32)
        for i, ids in enumerate(sequences):
            tokens[i, : len(ids)] = ids
        tokens = jax.device_put(tokens, self.layout.sharding(("batch", "seq")))
        out = np.asarray(self.run("logits", tokens))
        return [out[i, : len(ids)] for i, ids in enumerate(sequences)]

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 tokenizer: Tokenizer | None) -> list[Completion]:
        """Prefill every prompt at once, then decode the batch until every row has finished."""
        for ids in prompts:
            self.check_prompt(ids)
        n, limit = len(prompts), self.cfg.context_length
        budget = [min(p.max_tokens, limit - len(ids)) for ids, p in zip(prompts, params, strict=True)]
        B = self.batch_shape(n)
        T = min(bucket(max(map(len, prompts)), 16), limit)
        S = min(bucket(max(len(ids) + b for ids, b in zip(prompts, budget, strict=True)), 128), limit)
        seeds = [p.seed if p.seed is not None else int(np.random.randint(2**31)) for p in params]
        sampling = jax.device_put(SamplingArrays.from_params(params, B, seeds))
        tokens = np.zeros((B, T), np.int32)
        last = np.zeros(B, np.int32)
        for i, ids in enumerate(prompts):
            tokens[i, : len(ids)], last[i] = ids, len(ids) - 1
        rows = [_Row(ids, p, b, self.cfg.eos_token_ids, tokenizer) for ids, p, b in zip(prompts, params, budget,
                                                                                       strict=True)]
        self.stats = StepStats(batch=B, cache_length=S, prefill_tokens=sum(map(len, prompts)))
        shard = self.layout.sharding
        cache = self.new_cache(B, S)
        positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
        prefill_args = (jax.device_put(tokens, shard(("batch", "seq"))),
                        jax.device_put(positions, shard(("batch", "seq"))), jax.device_put(last, shard(("batch",))))
        next_tokens, cache = self._timed("prefill", cache, *prefill_args, sampling)
        pos = last + 1
        while True:
            for i, row in enumerate(rows):
                row.add(int(next_tokens[i]))
            if all(r.finish_reason for r in rows):
                break
            next_tokens, cache = self._timed("decode", cache, jax.device_put(next_tokens, shard(("batch",))),
                                             jax.device_put(pos, shard(("batch",))), sampling)
            pos = pos + 1
            self.stats.decode_steps += 1
        self.stats.decode_tokens = sum(len(r.token_ids) - 1 for r in rows)
        return [r.completion() for r in rows]

    def _timed(self, step: str, *args):
        """Runs a step to completion; its time, without compilation, is added to the stats."""
        compile_before = self.stats.compile_seconds
        t0 = time.perf_counter()
        next_tokens, cache = self.run(step, *args)
        next_tokens = np.asarray(next_tokens)
        seconds = time.perf_counter() - t0 - (self.stats.compile_seconds - compile_before)
        setattr(self.stats, f"{step}_seconds", getattr(self.stats, f"{step}_seconds") + seconds)
        return next_tokens, cache


class _Row:
    """One request's host-side state: its tokens, stop conditions and text."""

    def __init__(self, prompt, params: SamplingParams, budget: int, eos: tuple[int, ...], tokenizer):
        self.prompt, self.params, self.budget = prompt, params, budget
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.text = IncrementalDetokenizer(tokenizer, prompt, params.stop, params.include_stop_str_in_output) \
            if tokenizer is not None else None

    def add(self, token: int) -> None:
        if self.finish_reason:
            return
        self.token_ids.append(token)
        if self.text is not None:
            self.text.add(token)
        if token in self.stop_ids or (self.text is not None and self.text.stopped):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.budget:
            self.finish_reason = "length"

    def completion(self) -> Completion:
        text = ""
        if self.text is not None:
            self.text.finish()
            text = self.text.text
        return Completion(text, self.token_ids, self.finish_reason or "length", self.prompt)
