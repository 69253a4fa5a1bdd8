"""The engine loop: requests in, tokens out, one device step at a time.

Each step every replica's scheduler picks its work (decodes and prefill chunks together, a plain
SchedulerOutput); the packer (jaxinfer.engine.packer) lays it out as one bucketed batch; the ModelRunner
runs it on the mesh and samples; each scheduler takes its sampled tokens back and says which requests
finished.

One queue holds what the device has been sent and the host has not handed out (vLLM v1's batch queue):
each entry is a microbatch, one SchedulerOutput per replica, and, once a device call returns its tokens,
that call. Under pp the step is one call of the pipeline (jaxinfer.device.pipeline): the new microbatch
enters stage 0 and the tokens that come back are those of the microbatch scheduled pp - 1 steps earlier,
so the last pp - 1 entries are the microbatches at stages 1 .. pp - 1; with pp=1 a call returns its own.

Overlapped scheduling (EngineConfig.overlap, the default): the host schedules, packs and dispatches step
k+1 while step k runs, and only then waits for step k's tokens and hands them out, so the device does not
wait for the host's work between steps. Tokens the host has not seen yet are taken on the device from
step k's output (jaxinfer.engine.scheduler). The tokens are those of the synchronous loop
(`overlap=False`, kept for debugging); a stop is seen one step late and the token drawn after it dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.device.attention import choose_backend
from jaxinfer.device.compilation_cache import executables_dir
from jaxinfer.device.kv_cache import PagedKVCache, page_bytes, pool_pages
from jaxinfer.device.layers import Weights
from jaxinfer.device.pipeline import PipelineRunner
from jaxinfer.device.runner import Dispatched, ModelRunner
from jaxinfer.distributed import shared_seed
from jaxinfer.engine.packer import GREEDY, Microbatch, Packer, bucket_shape, has_work
from jaxinfer.engine.page_pool import PagePool
from jaxinfer.engine.scheduler import Request, ScheduledSequence, Scheduler, SchedulerOutput
from jaxinfer.engine.stats import EngineStats, ExpertLoad
from jaxinfer.models import Model
from jaxinfer.sampling import SamplingParams
from jaxinfer.sharding import Layout, device_bytes, kv_head_repeat, validate_sp
from jaxinfer.step import ring_order
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestError(ValueError):
    """A request that cannot be served: the message names the value and the limit; `param` the field at fault
    (e.g. "prompt", "max_tokens"), where there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineStalled(RuntimeError):
    """Requests are queued but no step can make progress: a bug, reported instead of spinning forever."""


@dataclasses.dataclass(eq=False)
class InFlight:
    """A microbatch sent to the device whose tokens are not handed out yet: per replica its work (None: a
    pipeline stage that held nothing), and, once it has left the last stage, the call that returns them."""

    work: Microbatch
    call: Dispatched | None = None
    prefill: bool = False       # that call had prompt tokens (on any stage)
    busy_seen: float = 0.0      # the latest time that call was seen still running (the device idle estimate)

    def ready(self, now: float) -> bool:
        """Whether its call's outputs are ready (non-blocking); if not, the device is still busy at `now`."""
        if self.call.ready():
            return True
        self.busy_seen = now
        return False


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str          # "stop" (EOS, stop token or stop string), "length" or "abort"
    prompt_token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # per new token: {its id and the top ids: log-probability}
    stop_reason: int | str | None = None            # the stop token id or stop string that ended it (vLLM's)
    # SamplingParams.prompt_logprobs: per prompt token, as `logprobs` (the first None: it has no context)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None    # each prompt token's rank in the vocabulary (1: most likely)

    @classmethod
    def of(cls, r: Request) -> Completion:
        asked = r.params.prompt_logprobs is not None
        return cls(r.text, list(r.output), r.finish_reason, list(r.prompt),
                   list(r.logprobs) if r.params.logprobs is not None else None, r.stop_reason,
                   list(r.prompt_logprobs) if asked else None, list(r.prompt_ranks) if asked else None)


class Engine:
    """The requests, the per-replica schedulers and the device runner of one model on one mesh."""

    def __init__(self, model: Model, layout: Layout, weights: Weights, dtype, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, allocate: bool = True):
        """weights: arrays, or their shapes while they load (LLM sets the runner's when they have); allocate=False:
        the KV pool's shapes only, for an engine that compiles its steps and never runs them (jaxinfer.plan)."""
        self.config = config = config or EngineConfig()
        self.cfg, self.layout, self.dtype, self.tokenizer = model.cfg, layout, dtype, tokenizer
        cfg = self.cfg
        device = next(d for d in layout.mesh.devices.flat if d.process_index == jax.process_index())  # one of ours
        self.sp = layout.axis_size("seq")                                 # sp: ranks a sequence is split over
        validate_sp(self.sp, cfg.context_length, config.page_size)
        backend = choose_backend(config.attention_backend, layout.platform, cfg.head_dim, config.page_size)
        tp = layout.axis_size("kv_heads")
        self.kv_heads = cfg.num_kv_heads * kv_head_repeat(cfg, tp)      # after replication for tp
        self.stages = layout.axis_size("layers")                          # pp: pipeline stages
        per_page = page_bytes(weights.stage_layers, self.kv_heads // tp, config.page_size, cfg.head_dim, dtype,
                              config.kv_cache_dtype)                # quantized pages: their scales counted
        self.pages_per_replica = self.sp * pool_pages(config, device, device_bytes(weights, device), per_page,
                                                      cfg.context_length)
        replicas = layout.axis_size("batch")                              # dp x ep replicas
        make_cache = PagedKVCache.zeros if allocate else PagedKVCache.shapes
        cache = make_cache(self.stages * weights.stage_layers, self.kv_heads, replicas * self.pages_per_replica,
                           config.page_size, cfg.head_dim, dtype, layout, config.kv_cache_dtype)
        self.kv_cache_dtype = jnp.dtype(cache.k.dtype).name      # what the pages hold: the model's dtype, int8, ...
        self.kv_bytes_per_token = per_page // config.page_size    # per device, all layers, scales included
        self.packer = packer = Packer(config.page_size, self.pages_per_replica, min(cfg.context_length, self.capacity),
                                      config.max_tokens_per_step, config.max_num_seqs, self.sp, self.stages)
        self.runner = (PipelineRunner if self.stages > 1 else ModelRunner)(
            model, layout, weights, cache, backend, max_seqs=packer.max_seqs,
            executables=executables_dir() if config.compilation_cache else None)
        self.overlap = config.overlap
        self.schedulers = [Scheduler(PagePool(self.pages_per_replica, config.page_size, config.prefix_caching, self.sp),
                                     config.max_num_seqs, packer.max_tokens, self.stages, self.overlap)
                           for _ in range(replicas)]
        self.queue = self._empty_pipeline()   # what the device was sent and the host has not handed out
        self.requests: dict[str, tuple[Request, Scheduler]] = {}
        self._stepping = False
        self._deferred_aborts: list[str] = []   # asked for by token callbacks during a step
        self._suspects: list[Request] = []      # requests of a failed step, each to pass a step alone
        self.stats = EngineStats()
        self.expert_load = ExpertLoad()
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(shared_seed())  # unseeded requests: same draws on every host

    @property
    def capacity(self) -> int:
        """Tokens one replica's page pool holds (over all its sp ranks)."""
        return self.pages_per_replica * self.config.page_size

    @property
    def compilations(self) -> int:
        return self.runner.compilations

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    on_token: Callable[[Request, int, str], None] | None = None) -> Request:
        """Queue a request on the least loaded replica. Refused at once if it can never be served."""
        self.check_request(prompt, params)
        if request_id is None:
            request_id = next(i for i in (f"req-{n}" for n in self._ids) if i not in self.requests)
        elif request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**31))
        eos = frozenset() if params.ignore_eos else frozenset(self.cfg.eos_token_ids)
        detok = (IncrementalDetokenizer(self.tokenizer, prompt, params.stop, params.include_stop_str_in_output)
                 if self.tokenizer is not None else None)
        budget = min(params.max_tokens, self.cfg.context_length - len(prompt))
        r = Request(request_id, list(prompt), params, seed, budget, eos | set(params.stop_token_ids), detok, on_token)
        scheduler = min(self.schedulers, key=len)
        scheduler.add(r)
        self.requests[request_id] = (r, scheduler)
        return r

    def room(self, prompt_tokens: int) -> int:
        """The most new tokens a request with a prompt of this length can get: to the context limit or to the
        end of one replica's page pool, whichever comes first."""
        return min(self.cfg.context_length, self.capacity) - prompt_tokens

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """A request that can never be served is refused now, not cut short later: its prompt (check_prompt), and
        its prompt with all its max_tokens (those the context limit allows) must fit one replica's page pool.
        Under sp a replica's pool is its sp ranks' pages together, since a sequence's pages go round the ranks."""
        self.check_prompt(prompt)
        need = len(prompt) + min(params.max_tokens, self.cfg.context_length - len(prompt))
        if need > self.capacity:
            raise RequestError(f"the prompt's {len(prompt)} tokens and max_tokens={params.max_tokens} need {need} "
                               f"tokens of KV cache, more than the page pool's {self.capacity} tokens per replica; "
                               f"ask for at most {self.room(len(prompt))} new tokens or give the cache more pages "
                               f"(num_pages)", param="max_tokens")

    def check_prompt(self, ids: list[int], generate: bool = True) -> None:
        """A prompt to generate from needs a free position after it; one to score does not."""
        limit, room = self.cfg.context_length, 1 if generate else 0
        if not ids:
            raise RequestError("empty prompt: give at least one token", param="prompt")
        if len(ids) + room > limit:
            raise RequestError(f"prompt of {len(ids)} tokens does not fit the context limit of {limit} tokens"
                               + (" (it needs at least one free position to generate)" if generate else "")
                               + "; shorten it", param="prompt")
        if len(ids) + room > self.capacity:
            raise RequestError(f"prompt of {len(ids)} tokens does not fit the KV page pool of {self.capacity} tokens "
                               f"per replica; shorten it or give the cache more pages (num_pages)", param="prompt")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int | np.integer)
               or not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary of {self.cfg.vocab_size}",
                               param="prompt")

    def abort(self, request_id: str) -> bool:
        """Stop a request and return its pages; False if it is unknown or already finished. Asked for from a
        token callback (inside a step), it takes effect when the step's tokens have all been handed out."""
        entry = self.requests.get(request_id)
        if entry is None or entry[0].finish_reason is not None:
            return False
        if self._stepping:
            self._deferred_aborts.append(request_id)
            return True
        r, scheduler = self.requests.pop(request_id)
        scheduler.finish(r)
        r.finish_reason = "abort"
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or any(e.call is not None or has_work(e.work) for e in self.queue)

    def reset_prefix_cache(self) -> None:
        """Empty every replica's prefix cache (e.g. between benchmark passes)."""
        for s in self.schedulers:
            s.pool.reset_prefix_cache()

    # ---- the step loop -----------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule and dispatch one device step, and hand out the tokens of the calls that are due (this
        one's; overlapped, the one's before); returns the requests that finished, those that failed among them
        (finish_reason "error", `error` set: see `_step_failed`)."""
        t_start, cpu_start = time.perf_counter(), time.thread_time()
        compiled = self.runner.compile_seconds, self.runner.compile_cpu_seconds, self.stats.host_seconds
        pipe = [e for e in self.queue if e.call is None]      # the microbatches at stages 1 .. pp - 1
        previous = next((e for e in reversed(self.queue) if e.call is not None), None)
        if previous is not None:
            previous.ready(t_start)
        self._suspects = [r for r in self._suspects if r.finish_reason is None]
        probe = self._suspects[0] if self._suspects else None
        outputs = [s.schedule(probe) for s in self.schedulers]
        stages = [outputs, *(e.work for e in reversed(pipe))]   # stages[s]: the microbatch stage s runs now
        t_scheduled = time.perf_counter()
        self.stats.schedule_seconds += t_scheduled - t_start
        leaving = None
        if any(map(has_work, stages)):
            prefill = any(o.prefill for mb in stages if mb for o in mb)
            unpacked: dict[str, BaseException] = {}
            try:
                batch = self.packer.pack_stages(stages, unpacked)
                self._fail_ids(unpacked)
                self.stats.pack_seconds += time.perf_counter() - t_scheduled
                if previous is not None and previous.ready(now := time.perf_counter()):
                    self.stats.idle_seconds += now - previous.busy_seen   # the device ran dry: at most this long
                call = self.runner.step(batch, "prefill" if prefill else "decode")
            except Exception as e:  # noqa: BLE001 - the step's requests are suspects, the others go on
                return self._failed() + self._step_failed(_request_ids(stages), e)
            self.queue.append(InFlight(outputs))
            leaving = pipe[0] if pipe else self.queue[-1]      # the microbatch leaving the last stage
            leaving.call, leaving.prefill, leaving.busy_seen = call, prefill, time.perf_counter()
            self.stats.dispatched(call.timing, [has_work(mb) for mb in stages], outputs if prefill else [])
        elif previous is None:
            if self.requests:
                raise EngineStalled(self._stall_report())
            return self._failed()
        # overlapped, the call just made is handed out next step; a suspect's probe at once, so that whether its
        # step passed is known before the next one
        wait = leaving if self.overlap and probe is None else None
        finished, handed = [], []
        while self.queue and self.queue[0].call is not None and self.queue[0] is not wait:
            entry = self.queue.popleft()
            try:
                finished += self._hand_out(entry)
            except Exception as e:  # noqa: BLE001 - the device step failed: its requests are suspects, and those
                # still in flight, which the failed call's state carried
                in_flight = [entry.work, *(e.work for e in self.queue)]
                return self._failed() + self._step_failed(_request_ids(in_flight), e)
            handed.append(entry)
        finished += self._failed()
        self.stats.stepped(t_start, cpu_start, compiled, self.runner, leaving, handed, self.overlap)
        self.stats.preemptions = sum(sch.preemptions for sch in self.schedulers)
        return finished

    # ---- failures ----------------------------------------------------------------------------
    # A failure that one request can be blamed for (while it is added, scheduled, packed, or its tokens handed
    # out) fails that request alone, as if it had been aborted: the scheduler drops it where it failed and the
    # step goes on without it (a sequence that cannot be packed is laid out inert in its slot). A failure of
    # the step itself (dispatching, the device, or the engine's own bookkeeping) loses what was in flight, the
    # KV pool too when the failed call had it donated: `_step_failed` restarts every request from its tokens
    # and runs the failed step's requests alone, one at a time, so that the one at fault fails alone.

    def recover(self, error: BaseException) -> list[Request]:
        """After `error` escaped step(): the requests it may concern are those running, treated as a failed
        step's (`_step_failed`). Returns the requests that failed."""
        running = [r.id for s in self.schedulers for r in s.running]
        return self._failed() + self._step_failed(running or list(self.requests), error)

    def _step_failed(self, request_ids: list[str], error: BaseException) -> list[Request]:
        """A step of these requests failed with `error`, and what was in flight with it: every request restarts
        from its tokens (as after preemption; a pool whose buffers the failed call took is made anew, zeros,
        and the prefix cache emptied), and the step's requests become suspects that run one per step
        (`schedule(only=...)`) until a step of theirs passes. A suspect that fails, alone or a second time, fails
        with `error`. Returns the requests that failed."""
        suspects = [self.requests[i][0] for i in dict.fromkeys(request_ids) if i in self.requests]
        self.queue = self._empty_pipeline()
        for scheduler in self.schedulers:
            scheduler.restart()
        if not self.runner.state_survived():
            self.runner.reset_state()
            for scheduler in self.schedulers:
                scheduler.pool.reset_prefix_cache()
        for r in suspects:
            if len(suspects) == 1 or r.suspected:
                self.requests[r.id][1].fail(r, error)
            elif r not in self._suspects:
                r.suspected = True
                self._suspects.append(r)
        return self._failed()

    def _fail_ids(self, errors: dict[str, BaseException]) -> None:
        for request_id, error in errors.items():
            entry = self.requests.get(request_id)
            if entry is not None and entry[0].finish_reason is None:
                entry[1].fail(entry[0], error)

    def _failed(self) -> list[Request]:
        """The requests the schedulers failed since the last call, now gone from the engine."""
        failed = [r for s in self.schedulers for r in s.failed]
        for s in self.schedulers:
            s.failed.clear()
        for r in failed:
            self.requests.pop(r.id, None)
        return failed

    def _empty_pipeline(self) -> collections.deque[InFlight]:
        """The queue with nothing sent: pp - 1 pipeline stages that hold nothing."""
        return collections.deque(InFlight(None) for _ in range(self.stages - 1))

    def _hand_out(self, entry: InFlight) -> list[Request]:
        """Wait for a call's tokens and give them to their requests (stop checks, detokenizing, stream
        callbacks)."""
        sampled, logprobs, counts, prompt = self.runner.collect_step(entry.call)
        t0 = time.perf_counter()
        if counts is not None:
            self.expert_load.record(counts.sum(axis=1))
        if prompt is None:
            prompt = [None] * len(sampled)
        else:   # in token order (from the ring's, under sp)
            prompt = prompt[:, np.argsort(ring_order(prompt.shape[1], self.sp))]
        self._stepping = True
        try:
            finished = [] if entry.work is None else [
                r for sched, out, row, lp, plp in zip(self.schedulers, entry.work, sampled, logprobs, prompt,
                                                      strict=True)
                for r in sched.update(out, row, lp, plp)]
        finally:
            self._stepping = False
        for r in finished:
            del self.requests[r.id]
        if self._suspects:   # a suspect whose step passed is cleared
            passed = set(_request_ids([entry.work]))
            self._suspects = [r for r in self._suspects if r.id not in passed]
        aborted, self._deferred_aborts = self._deferred_aborts, []
        for request_id in aborted:
            self.abort(request_id)
        self.stats.update_seconds += time.perf_counter() - t0
        return finished

    def _stall_report(self) -> str:
        parts = [f"replica {i}: {len(s.waiting)} waiting, {len(s.running)} running, {s.pool.available} of "
                 f"{s.pool.num_pages} pages available" for i, s in enumerate(self.schedulers)]
        return "no request can be scheduled although requests are queued (" + "; ".join(parts) + ")"

    # ---- conveniences over the loop ----------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        """Run requests to completion; all are validated before any is queued."""
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
        for ids, p in zip(prompts, params, strict=True):
            self.check_request(ids, p)
        requests = [self.add_request(ids, p) for ids, p in zip(prompts, params, strict=True)]
        while self.has_unfinished():
            self.step()
        return [Completion.of(r) for r in requests]

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[tuple[int, str]]:
        """(token id, text delta) as each token is produced, while the engine serves everything queued.
        Closing the generator early (or dropping it) aborts the request."""
        events: list[tuple[int, str]] = []
        r = self.add_request(prompt, params, on_token=lambda _, token, delta: events.append((token, delta)))
        try:
            while r.finish_reason is None:
                self.step()
                yield from events
                events.clear()
        finally:
            self.abort(r.id)

    def score(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """float32 logits [T, V] of each sequence (up to the full context).

        Sequences are packed into steps as prompts are: each replica takes whole sequences while it has pages
        for them (at most max_num_seqs at once) and fills each step's token budget with their next tokens, so
        short sequences share a step and long ones run in chunks; each sequence's pages are returned as soon
        as it is scored."""
        for ids in sequences:
            self.check_prompt(ids, generate=False)
        rows: list[list[np.ndarray]] = [[] for _ in sequences]
        waiting = collections.deque(range(len(sequences)))
        pools = [scheduler.pool for scheduler in self.schedulers]
        held: list[list[_Scoring]] = [[] for _ in pools]
        try:
            while waiting or any(held):
                for pool, mine in zip(pools, held, strict=True):
                    while waiting and len(mine) < self.config.max_num_seqs:
                        pages = pool.allocate(-(-len(sequences[waiting[0]]) // pool.page_size))
                        if pages is None:
                            break
                        mine.append(_Scoring(waiting.popleft(), pages))
                if not any(held):
                    raise RequestError("the KV page pool is too busy to score now; retry when the engine is idle")
                outputs = [SchedulerOutput(self._score_chunks(sequences, mine)) for mine in held]
                logits = self.runner.score(self.packer.pack(outputs, bucket_shape(outputs, self.sp)))
                logits = logits[:, np.argsort(ring_order(logits.shape[1], self.sp))]   # rows back in token order
                for pool, out, row, mine in zip(pools, outputs, logits, held, strict=True):
                    offsets = np.cumsum([0] + [len(seq.token_ids) for seq in out.sequences])
                    for scoring, a, b in zip(mine, offsets[:-1], offsets[1:], strict=False):
                        rows[scoring.index].append(row[a:b])
                        scoring.done += b - a
                    for scoring in [x for x in mine if x.done == len(sequences[x.index])]:
                        pool.release(scoring.pages)
                        mine.remove(scoring)
        finally:
            for pool, mine in zip(pools, held, strict=True):
                for scoring in mine:
                    pool.release(scoring.pages)
        return [np.concatenate(r) for r in rows]

    def _score_chunks(self, sequences: list[list[int]], held: list[_Scoring]) -> list[ScheduledSequence]:
        """One step's share of a replica's sequences being scored: their next tokens, in order, up to the budget."""
        budget, chunks = self.packer.max_tokens, []
        for s in held:
            n = min(budget, len(sequences[s.index]) - s.done)
            if n == 0:
                break
            chunk = list(sequences[s.index][s.done: s.done + n])
            chunks.append(ScheduledSequence("score", chunk, s.done, s.pages, GREEDY, 0, samples=False, prefill=True))
            budget -= n
        return chunks


def _request_ids(microbatches: list[Microbatch]) -> list[str]:
    """The requests of these microbatches (per replica: a SchedulerOutput, or None), in order."""
    return [seq.request_id for mb in microbatches if mb for out in mb for seq in out.sequences]


@dataclasses.dataclass
class _Scoring:
    """A sequence being scored (Engine.score): its index among those asked for, its pages, tokens done."""

    index: int
    pages: np.ndarray
    done: int = 0
