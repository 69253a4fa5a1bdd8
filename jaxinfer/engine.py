"""The engine: host-side continuous batching around one jitted device step.

Each step the replicas' schedulers pick their tokens (decodes and prefill chunks together); the host
packs them into one flat ragged batch per replica, padded to bucket shapes so that a steady workload
compiles nothing new:
- tokens per replica: a power of two, at most the step's token budget;
- sequences per replica: a power of two, at most max_num_seqs rounded up;
- pages per sequence in the page table: a power of two.
The device step runs the model over the batch, writes K/V into the donated page pool, and samples one
token per sequence; the host keeps only the tokens of sequences whose prompt is complete.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.attention import StepMetadata, choose_backend
from jaxinfer.config import ModelConfig
from jaxinfer.distributed import shared_seed, to_host
from jaxinfer.kv_cache import PagedKVCache, page_bytes, pages_from_budget
from jaxinfer.page_pool import PagePool
from jaxinfer.sampling import SamplingArrays, SamplingParams, sample
from jaxinfer.scheduler import Replica, Request
from jaxinfer.sharding import Layout, device_bytes
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer

CPU_KV_BUDGET = 2 << 30  # bytes of KV pages per device where the device does not report its memory


class RequestError(ValueError):
    """A request that cannot be served: the message names the value and the limit."""


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str          # "stop" (EOS, stop token or stop string) or "length"
    prompt_token_ids: list[int]


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
        """max / mean tokens per expert, per layer (1.0 is perfect balance)."""
        mean = counts.mean(axis=-1)
        return np.where(mean > 0, counts.max(axis=-1) / np.where(mean > 0, mean, 1), 0.0)

    def report(self) -> dict:
        if self.total is None:
            return {}
        return {"last_step": {"tokens_per_expert": self.last.tolist(), "imbalance": self.imbalance(self.last).tolist()},
                "total": {"tokens_per_expert": self.total.tolist(), "imbalance": self.imbalance(self.total).tolist()}}


@struct.dataclass
class StepBatch:
    tokens: jax.Array           # int32 [R, N]
    logits_index: jax.Array     # int32 [R, S] the last token of each sequence in this step
    sample_positions: jax.Array  # int32 [R * S] position of the token each sequence samples
    sampling: SamplingArrays    # [R * S]
    meta: StepMetadata


def _global_array(x: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array | np.ndarray:
    """A host array (identical on every process) placed as the compiled step expects it; an input the
    step does not use (no sharding: the scoring step samples nothing) is passed as it is."""
    return x if sharding is None else jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def bucket(n: int, minimum: int = 1, multiple: int = 1) -> int:
    size = max(minimum, 1 << (max(n, 1) - 1).bit_length())
    return -(-size // multiple) * multiple


class Engine:
    """Owns the sharded weights, the page pool and the compiled step of one model on one mesh."""

    def __init__(self, model, cfg: ModelConfig, layout: Layout, params: dict, dtype, kv_heads: int, *,
                 tokenizer: Tokenizer | None = None, page_size: int = 16, num_pages: int | None = None,
                 memory_fraction: float = 0.9, max_num_seqs: int = 32, max_tokens_per_step: int = 256,
                 prefix_caching: bool = True, attention_backend: str | None = None):
        self.model, self.cfg, self.layout, self.params = model, cfg, layout, params
        self.dtype, self.kv_heads, self.tokenizer = dtype, kv_heads, tokenizer
        device = next(d for d in layout.mesh.devices.flat if d.process_index == jax.process_index())  # one of ours
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size={page_size} must be a power of two")
        self.backend = choose_backend(attention_backend, device.platform, cfg.head_dim, page_size)
        self.max_tokens = bucket(max_tokens_per_step, 16)
        self.max_seqs = max_num_seqs
        replicas, tp = layout.axis_size("batch"), layout.mesh.shape["tp"]   # dp x ep replicas
        per_page = page_bytes(cfg.num_layers, kv_heads // tp, page_size, cfg.head_dim, dtype)
        if num_pages is None:
            num_pages = pages_from_budget(device, device_bytes(params, device), per_page, memory_fraction)
            if num_pages is None:  # CPU: enough for every sequence slot at full context, within a budget
                num_pages = min(max_num_seqs * -(-cfg.context_length // page_size), CPU_KV_BUDGET // per_page)
        if num_pages < 1:
            raise ValueError(f"no room for KV pages: {num_pages} pages of {per_page} bytes per device")
        self.pages_per_replica = num_pages
        self.cache = PagedKVCache.zeros(cfg.num_layers, kv_heads, replicas * num_pages, page_size, cfg.head_dim,
                                        dtype, layout)
        self.replicas = [Replica(PagePool(num_pages, page_size, prefix_caching), max_num_seqs, self.max_tokens)
                         for _ in range(replicas)]
        self.requests: dict[str, tuple[Request, Replica]] = {}
        self.stats = EngineStats()
        self.expert_load = ExpertLoad()
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        self.last: dict[str, jax.stages.Compiled] = {}
        self._jitted = {"step": jax.jit(self._step, donate_argnums=(1,)),
                        "score": jax.jit(self._score, donate_argnums=(1,))}
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(shared_seed())  # unseeded requests: same draws on every host

    # ---- device ------------------------------------------------------------------------------
    def _hidden(self, params, cache, batch: StepBatch):
        return self.model.forward(params, batch.tokens, cache, batch.meta, self.cfg, self.layout)

    def _step(self, params, cache, batch: StepBatch):
        h, cache, aux = self._hidden(params, cache, batch)
        last = jnp.take_along_axis(h, batch.logits_index[..., None], axis=1)        # per-row gather
        logits = self._real_vocab(self.model.lm_head(params, last))                 # [R, S, V]
        R, S, V = logits.shape
        logits = self.layout.constrain(logits, ("batch", None, "vocab"))  # pinned: gather logits, not weights
        logits = self.layout.constrain(logits, ("batch", None, None)).reshape(R * S, V)
        return (sample(logits, batch.sampling, batch.sample_positions).reshape(R, S), aux), cache

    def _score(self, params, cache, batch: StepBatch):
        h, cache, _ = self._hidden(params, cache, batch)
        logits = self.layout.constrain(self.model.lm_head(params, h), ("batch", "seq", "vocab"))
        return self.layout.constrain(logits, ("batch", "seq", None))[..., : self.cfg.vocab_size], cache

    def _real_vocab(self, logits: jax.Array) -> jax.Array:
        """Rows added to pad the vocabulary to a multiple of tp can never be sampled."""
        padded = logits.shape[-1]
        if padded == self.cfg.vocab_size:
            return logits
        return jnp.where(jnp.arange(padded) < self.cfg.vocab_size, logits, -jnp.inf)

    @property
    def capacity(self) -> int:
        """Tokens one replica's page pool holds."""
        return self.pages_per_replica * self.replicas[0].pool.page_size

    @property
    def compilations(self) -> int:
        return len(self.executables)

    def run(self, step: str, batch: StepBatch, phase: str | None = None):
        """Compile ahead of time once per bucket (timed apart), then execute on the donated cache.
        The executable is remembered as the latest of its phase, for the collective report."""
        key = (step, *(jax.typeof(x) for x in jax.tree.leaves(batch)))
        if key not in self.executables:
            t0 = time.perf_counter()
            self.executables[key] = self._jitted[step].lower(self.params, self.cache, batch).compile()
            self.stats.compile_seconds += time.perf_counter() - t0
        exe = self.last[phase or step] = self.executables[key]
        batch = jax.tree.map(_global_array, batch, exe.input_shardings[0][2])  # the same on every host
        out, self.cache = exe(self.params, self.cache, batch)
        return jax.tree.map(to_host, out)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    on_token: Callable[[Request, int, str], None] | None = None) -> Request:
        """Queue a request on the least loaded replica. Refused at once if it can never be served."""
        self.check_prompt(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**31))
        eos = frozenset() if params.ignore_eos else frozenset(self.cfg.eos_token_ids)
        detok = (IncrementalDetokenizer(self.tokenizer, prompt, params.stop, params.include_stop_str_in_output)
                 if self.tokenizer is not None else None)
        budget = min(params.max_tokens, self.cfg.context_length - len(prompt), self.capacity - len(prompt))
        r = Request(request_id, list(prompt), params, seed, budget, eos | set(params.stop_token_ids), detok, on_token)
        replica = min(self.replicas, key=len)
        replica.waiting.append(r)
        self.requests[request_id] = (r, replica)
        return r

    def check_prompt(self, ids: list[int]) -> None:
        limit = self.cfg.context_length
        if not ids:
            raise RequestError("empty prompt: give at least one token")
        if len(ids) >= limit:
            raise RequestError(f"prompt of {len(ids)} tokens does not fit the context limit of {limit} tokens "
                               f"(it needs at least one free position to generate); shorten it")
        if len(ids) >= self.capacity:
            raise RequestError(f"prompt of {len(ids)} tokens does not fit the KV page pool of {self.capacity} tokens "
                               f"per replica; shorten it or give the cache more pages (num_pages)")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary of {self.cfg.vocab_size}")

    def abort(self, request_id: str) -> bool:
        """Stop a request now and return its pages; False if it is unknown or already finished."""
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return False
        r, replica = entry
        replica.finish(r)
        r.finish_reason = r.finish_reason or "abort"
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step loop -----------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, run one device step, hand out the sampled tokens; returns the requests that finished."""
        plans = [replica.schedule() for replica in self.replicas]
        if not any(plans):
            return []
        prefill = any(n > 1 or not r.output for plan in plans for r, n in plan)
        t0 = time.perf_counter()
        compile_before = self.stats.compile_seconds
        sampled, aux = self.run("step", self._pack(plans), phase="prefill" if prefill else "decode")
        if "expert_counts" in aux:
            self.expert_load.record(aux["expert_counts"].sum(axis=1))
        seconds = time.perf_counter() - t0 - (self.stats.compile_seconds - compile_before)
        finished, new_tokens = [], 0
        for replica, plan, row in zip(self.replicas, plans, sampled, strict=True):
            for s, (r, n) in enumerate(plan):
                replica.computed(r, n)
                if r.pending == 0:
                    r.add_token(int(row[s]))
                    new_tokens += 1
                    if r.finish_reason:
                        replica.finish(r)
                        del self.requests[r.id]
                        finished.append(r)
        self.stats.steps += 1
        self.stats.preemptions = sum(rep.preemptions for rep in self.replicas)
        if prefill:
            self.stats.prefill_steps += 1
            self.stats.prefill_seconds += seconds
            self.stats.prefill_tokens += sum(n for plan in plans for _, n in plan)
        else:
            self.stats.decode_seconds += seconds
            self.stats.decode_tokens += new_tokens
            self.stats.decode_steps += 1
        return finished

    def _pack(self, plans: list[list[tuple[Request, int]]]) -> StepBatch:
        """One flat ragged batch per replica, padded to shared bucket shapes."""
        P = self.replicas[0].pool.page_size
        N = bucket(max(sum(n for _, n in plan) for plan in plans))
        S = bucket(max(map(len, plans)))
        max_pages = bucket(max((len(r.pages) for plan in plans for r, _ in plan), default=1))
        R = len(plans)
        sentinel = self.pages_per_replica * P
        tokens, positions = np.zeros((R, N), np.int32), np.zeros((R, N), np.int32)
        slots = np.full((R, N), sentinel, np.int32)
        page_table = np.zeros((R, S, max_pages), np.int32)
        seq_lens, logits_index = np.zeros((R, S), np.int32), np.zeros((R, S), np.int32)
        query_start, num_seqs = np.zeros((R, S + 1), np.int32), np.zeros(R, np.int32)
        params, seeds = [SamplingParams(temperature=0)] * (R * S), [0] * (R * S)
        for i, plan in enumerate(plans):
            t = 0
            for s, (r, n) in enumerate(plan):
                pos = np.arange(r.computed, r.computed + n)
                tokens[i, t: t + n] = r.tokens[r.computed: r.computed + n]
                positions[i, t: t + n] = pos
                slots[i, t: t + n] = np.asarray(r.pages)[pos // P] * P + pos % P
                page_table[i, s, : len(r.pages)] = r.pages
                seq_lens[i, s] = r.computed + n
                logits_index[i, s] = t + n - 1
                query_start[i, s + 1] = t + n
                params[i * S + s], seeds[i * S + s] = r.params, r.seed
                t += n
            query_start[i, len(plan) + 1:] = t
            num_seqs[i] = len(plan)
        meta = StepMetadata(positions, slots, page_table, seq_lens, query_start, num_seqs, backend=self.backend)
        return StepBatch(tokens, logits_index, seq_lens.reshape(-1), SamplingArrays.from_params(params, R * S, seeds),
                         meta)

    # ---- conveniences over the loop ----------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        """Run requests to completion (all validated before any is queued)."""
        for ids in prompts:
            self.check_prompt(ids)
        requests = [self.add_request(ids, p) for ids, p in zip(prompts, params, strict=True)]
        while self.has_unfinished():
            self.step()
        return [Completion(r.text, r.output, r.finish_reason, r.prompt) for r in requests]

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[tuple[int, str]]:
        """(token id, text delta) as each token is produced, while the engine serves everything queued."""
        events: list[tuple[int, str]] = []
        r = self.add_request(prompt, params, on_token=lambda _, token, delta: events.append((token, delta)))
        while r.finish_reason is None:
            self.step()
            yield from events
            events.clear()

    def score(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """float32 logits [T, V] of each sequence, computed in chunks through the same paged cache."""
        for ids in sequences:
            self.check_prompt(ids)
        replica, out = self.replicas[0], []
        for i, ids in enumerate(sequences):
            r = Request(f"score-{i}", list(ids), SamplingParams(temperature=0), 0, 0, frozenset())
            chunks = []
            try:
                while r.pending:
                    n = min(r.pending, self.max_tokens)
                    if not replica._grow(r, n):
                        raise RequestError("the KV page pool is too busy to score now; retry when the engine is idle")
                    plans = [[(r, n)]] + [[] for _ in self.replicas[1:]]
                    logits = self.run("score", self._pack(plans))
                    chunks.append(logits[0, :n])
                    r.computed += n
            finally:
                replica.pool.release(r.pages)
            out.append(np.concatenate(chunks))
        return out
