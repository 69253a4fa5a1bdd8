"""Host-side continuous batching for one data-parallel replica (vLLM v1's scheduler, in small).

Every step has a token budget. Running requests go first, oldest first: a decode takes one token, a
prefill the next chunk of its prompt that fits. When pages run out, the newest running request is
preempted: its pages are released and it goes back to the front of the queue, to be recomputed later
from its prompt and the tokens it already produced (so its output is what it would have been). Waiting
requests are admitted while budget, sequence slots and pages allow; their prompt's full pages are
looked up in the prefix cache first, and only the rest is prefilled. A request that cannot be admitted
holds no pages.

`schedule()` returns a plain `SchedulerOutput` (what to compute this step, nothing the device step has
to ask a Request for); `update()` takes the sampled tokens back, in the order the outputs were made.

Under a pipeline of P stages, P scheduled outputs are in flight before the first comes back. A request's
tokens are scheduled (sent to the device) before they are computed (in the cache on every stage): the
chunks of a long prompt go out in consecutive steps, but a request waiting for its next token is not
scheduled until the token is back. New requests are spread over the P in-flight microbatches (at most
1/P of the requests in each), so a burst does not fill one microbatch and leave the others empty. Only a
request with nothing in flight is preempted; aborting one that is in flight is safe, because a page it
frees is reused only by later microbatches, which reach every stage after it.

Overlapped scheduling (`overlap=True`): the engine dispatches a step before the previous step's tokens
reach the host, so a request whose token the previous step sampled is scheduled one decode ahead, its
next token a placeholder that the device fills from the previous step's sampled tokens
(`ScheduledSequence.feed`). Under a pipeline the previous step returned the microbatch scheduled P calls
ago, so a request is scheduled ahead when its sampling microbatch is that one. Stop conditions are applied
when the tokens come back, one step late: a request that stopped has its ahead token discarded. A request
whose length limit is reached is not scheduled ahead, since its end is known.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxinfer.engine.page_pool import PagePool, page_hashes
from jaxinfer.sampling import SamplingParams
from jaxinfer.tokenizer import IncrementalDetokenizer

NO_PAGES = np.zeros(0, np.int32)


@dataclasses.dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    budget: int                                  # new tokens allowed (max_tokens capped by context and pool)
    stop_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer | None = None
    on_token: Callable[[Request, int, str], None] | None = None
    output: list[int] = dataclasses.field(default_factory=list)
    pages: np.ndarray = dataclasses.field(default_factory=lambda: NO_PAGES)  # int32: its page table, grown
                                                 # by new arrays (a step's snapshot never changes)
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # chained keys of its full pages so far
    computed: int = 0                            # tokens whose keys/values are in the cache
    scheduled: int = 0                           # tokens sent to the device (computed, or in flight)
    unseen: int = 0                              # tokens sampled on the device, not yet back on the host
    sampled_at: tuple[int, int] = (-1, -1)       # (schedule call, sequence index) of its latest sampling step
    cached_tokens: int = 0                       # prompt tokens served from the prefix cache (last admission)
    finish_reason: str | None = None             # "stop", "length", "abort", or "error" (with `error`)
    stop_reason: int | str | None = None         # the stop token id or stop string that ended it (not EOS)
    error: BaseException | None = None           # what failed it
    suspected: bool = False                      # was in a step that failed: runs alone until a step of it passes
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    token_times: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)  # where params.logprobs is set
    # where params.prompt_logprobs is set: per prompt token so far (the first None: it has no context), as
    # `logprobs`, and its rank in the vocabulary (1: the most likely)
    prompt_logprobs: list[dict[int, float] | None] = dataclasses.field(default_factory=list)
    prompt_ranks: list[int | None] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_ranks = [None], [None]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole list (a decode step needs one token of it)."""
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p: end - p]
        return self.prompt[start:end] + (self.output[: end - p] if end > p else [])

    @property
    def in_flight(self) -> bool:
        """Tokens of it are on the device, not yet back."""
        return self.scheduled > self.computed

    @property
    def pending(self) -> int:
        """Known tokens not yet sent to the device."""
        return len(self.prompt) + len(self.output) - self.scheduled

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    @property
    def may_continue(self) -> bool:
        """Its tokens in flight may leave room for more: its length limit is not reached by them."""
        return len(self.output) + self.unseen < self.budget

    @property
    def prompt_logprobs_pending(self) -> int:
        """Prompt tokens whose log-probabilities were asked for and are not in yet."""
        return len(self.prompt) - len(self.prompt_logprobs) if self.params.prompt_logprobs is not None else 0

    def prompt_targets(self, start: int, n: int) -> np.ndarray | None:
        """For its tokens start .. start + n of a step: the prompt token whose log-probability each position's
        logits give, where it is asked for and not in yet (-1 elsewhere); None where no position is."""
        if self.params.prompt_logprobs is None:
            return None
        first = max(start, len(self.prompt_logprobs) - 1)          # the first position whose entry is not in
        last = min(start + n, len(self.prompt) - 1)                # the last prompt token has no next one
        if first >= last:
            return None
        targets = np.full(n, -1, np.int32)
        targets[first - start: last - start] = self.prompt[first + 1: last + 1]
        return targets

    def add_prompt_logprobs(self, start: int, targets: np.ndarray, rows: np.ndarray) -> None:
        """The prompt log-probabilities of a step that computed its tokens start..: rows[j] (the next prompt token's
        log-probability, its rank, K ids, K values) for each position j with a target, entry start + j + 1."""
        k = (rows.shape[-1] - 2) // 2
        for j in np.flatnonzero(targets >= 0).tolist():
            token, row = int(targets[j]), rows[j]
            top = zip(row[2: 2 + k][: self.params.prompt_logprobs], row[2 + k:][: self.params.prompt_logprobs],
                      strict=True)
            entry = {token: float(row[0]), **{int(i): float(v) for i, v in top if int(i) != token}}
            if start + j + 1 != len(self.prompt_logprobs):   # steps come back in order, each asked only once
                raise RuntimeError(f"prompt log-probability {start + j + 1} came back after "
                                   f"{len(self.prompt_logprobs) - 1}")
            self.prompt_logprobs.append(entry)
            self.prompt_ranks.append(int(row[1]))

    def add_token(self, token: int, logprobs: Sequence[float] | None = None) -> None:
        """Append a sampled token (with its log-probabilities from the sampler: its own, then K ids and K
        values), stream it, and decide whether the request is finished."""
        self.output.append(token)
        if self.params.logprobs is not None and logprobs is not None:
            k = (len(logprobs) - 1) // 2
            top = zip(logprobs[1: 1 + k][: self.params.logprobs], logprobs[1 + k:][: self.params.logprobs],
                      strict=True)
            self.logprobs.append({token: float(logprobs[0]), **{int(i): float(v) for i, v in top if int(i) != token}})
        self.token_times.append(time.perf_counter())
        delta = self.detokenizer.add(token) if self.detokenizer is not None else ""
        if token in self.stop_ids:                   # EOS (stop_reason None, as in vLLM) or a stop token
            self.finish_reason = "stop"
            self.stop_reason = token if token in self.params.stop_token_ids else None
        elif self.detokenizer is not None and self.detokenizer.stopped:
            self.finish_reason, self.stop_reason = "stop", self.detokenizer.stop_string
        elif len(self.output) >= self.budget:
            self.finish_reason = "length"
        if self.finish_reason and self.detokenizer is not None:
            delta += self.detokenizer.finish()
        if self.on_token is not None:
            self.on_token(self, token, delta)


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: compute `token_ids` at positions start.. and, if `samples`, draw the
    token that follows them."""

    request_id: str
    token_ids: list[int]
    start: int
    pages: np.ndarray            # int32: its page table, local page ids of the replica's pool
    params: SamplingParams
    seed: int
    samples: bool                # these tokens reach the end of what is known: sample the next one
    prefill: bool                # prompt (or recomputed) tokens, not a plain decode step
    feed: int = -1               # overlap: the last token is the one the previous step sampled at this index
    prompt_targets: np.ndarray | None = None  # int32 per token: the next prompt token whose log-probability its
                                 # logits give (Request.prompt_targets), -1 where not asked; None: none asked

    @property
    def end(self) -> int:
        """The sequence's KV length after this step."""
        return self.start + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """What one replica computes in one step."""

    sequences: list[ScheduledSequence]

    def __bool__(self) -> bool:
        return bool(self.sequences)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def prefill(self) -> bool:
        return any(s.prefill for s in self.sequences)


class Scheduler:
    """The requests and pages of one dp replica."""

    def __init__(self, pool: PagePool, max_seqs: int, max_tokens: int, stages: int = 1, overlap: bool = False):
        self.pool, self.max_seqs, self.max_tokens, self.stages = pool, max_seqs, max_tokens, stages
        self.overlap = overlap
        self.calls = 0                    # schedule() calls so far: the step a sampled token comes from
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.failed: list[Request] = []   # requests that failed here, for the engine to collect
        self._in_flight: collections.deque[list[Request]] = collections.deque()  # per non-empty output not updated

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, r: Request) -> None:
        self.waiting.append(r)

    def schedule(self, only: Request | None = None) -> SchedulerOutput:
        """This step's work: running requests first, then admissions. `only`: this request alone, if it is
        this replica's (a suspect's probe, jaxinfer.engine.core). A request that fails here fails alone (`fail`)
        and the step goes on without it."""
        budget, scheduled, short = self.max_tokens, [], False
        for r in [r for r in self.running if only is None or r is only]:
            if r not in self.running or budget == 0 or not self._pending(r):
                continue
            try:
                n = min(self._pending(r), budget)
                while not self._grow(r, n):
                    victim = next((q for q in reversed(self.running) if not q.in_flight), None)
                    short = True
                    if victim is None:       # every other request is in flight: wait for pages to come back
                        break
                    self.preempt(victim)
                    if victim is r:
                        break
                else:
                    r.scheduled += n
                    scheduled.append((r, n))
                    budget -= n
            except Exception as e:  # noqa: BLE001 - this request's failure, not the step's
                self.fail(r, e)
        if only is not None and only in self.waiting:
            self.waiting.remove(only)
            self.waiting.appendleft(only)
        share = -(-len(self) // self.stages)  # requests per in-flight microbatch, when spread evenly
        while (self.waiting and not short and budget and len(self.running) < self.max_seqs
               and len(scheduled) < share and (only is None or self.waiting[0] is only)):
            r = self.waiting[0]
            try:
                self._lookup_prefix(r)
                n = min(r.pending, budget)
                if not self._grow(r, n):
                    self._release(r)  # a request that is not admitted holds no pages
                    break
                self.waiting.popleft()
                self.running.append(r)
                r.scheduled += n
                scheduled.append((r, n))
                budget -= n
            except Exception as e:  # noqa: BLE001 - this request's failure, not the step's
                self.fail(r, e)
        sequences, sent = [], []
        for r, n in scheduled:
            if r.finish_reason is not None:
                continue
            try:
                sequences.append(self._describe(r, n, len(sequences)))
                sent.append(r)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the step's
                self.fail(r, e)
        if sent:
            self._in_flight.append(sent)
        self.calls += 1
        return SchedulerOutput(sequences)

    def _pending(self, r: Request) -> int:
        """Tokens of r to send: the known ones not yet sent and, overlapped, the one the previous step sampled
        (unless r's length limit ends it there)."""
        if self.overlap and r.unseen and r.may_continue and r.sampled_at[0] == self.calls - self.stages:
            return r.pending + r.unseen
        return r.pending

    def update(self, output: SchedulerOutput, sampled: Sequence[int],
               logprobs: Sequence[Sequence[float]] | None = None,
               prompt_logprobs: np.ndarray | None = None) -> list[Request]:
        """After the device step that completed `output` (the oldest one not yet updated): its tokens are in
        the cache, and each sequence that sampled gets its token (sampled[i] for output.sequences[i], with
        its log-probabilities logprobs[i]). prompt_logprobs: the step's [tokens, 2 + 2K] in token order, where
        it computed them (a sequence's rows follow the sequences before it), its requests' prompt entries
        taken in before their tokens. Requests aborted meanwhile are skipped. Returns the requests that
        finished."""
        finished = []
        if not output:
            return finished
        rows = logprobs if logprobs is not None else [None] * len(output.sequences)
        offsets = (itertools.accumulate((len(seq.token_ids) for seq in output.sequences), initial=0)
                   if prompt_logprobs is not None else itertools.repeat(0))    # where each sequence's rows start
        for r, seq, token, lp, at in zip(self._in_flight.popleft(), output.sequences, sampled, rows, offsets,
                                         strict=False):
            if r.finish_reason is not None:
                continue
            try:
                self._computed(r, len(seq.token_ids))
                if seq.prompt_targets is not None and prompt_logprobs is not None:
                    r.add_prompt_logprobs(seq.start, seq.prompt_targets,
                                          prompt_logprobs[at: at + len(seq.token_ids)])
                if seq.samples:
                    r.unseen -= 1
                    r.add_token(int(token), lp)
                    if r.finish_reason:
                        self.finish(r)
                        finished.append(r)
            except Exception as e:  # noqa: BLE001 - this request's failure (its detokenizer, its callback...)
                self.fail(r, e)
        return finished

    def preempt(self, r: Request) -> None:
        self._release(r)
        self.running.remove(r)
        self.waiting.appendleft(r)
        self.preemptions += 1

    def fail(self, r: Request, error: BaseException) -> None:
        """End r with `error`, as if aborted: its pages go back, its tokens in flight are dropped when they come
        back. The engine collects it from `failed`."""
        self.finish(r)
        r.finish_reason, r.error = "error", error
        self.failed.append(r)

    def restart(self) -> None:
        """Nothing is in flight any more and no request holds pages: the running ones go back to the front of the
        queue, in order, to recompute their KV from their tokens as a preempted request does (after a step
        failed and took the device's state with it)."""
        for r in reversed(self.running):
            self._release(r)
            self.waiting.appendleft(r)
        self.running.clear()
        self._in_flight.clear()

    def finish(self, r: Request) -> None:
        """Remove r (finished or aborted) and return its pages."""
        self._release(r)
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)

    def _describe(self, r: Request, n: int, index: int) -> ScheduledSequence:
        """r's next n tokens (already counted as scheduled), sequence `index` of this step's output. A token
        the device has not handed back yet (overlap) is the placeholder 0, fed from the previous step."""
        start, known = r.scheduled - n, r.token_slice(r.scheduled - n, r.scheduled)
        feed = -1
        if len(known) < n:
            call, feed = r.sampled_at
            assert len(known) == n - 1 and call == self.calls - self.stages, "a token comes from the call before"
            known.append(0)
        samples = r.pending == 0 and r.unseen == 0 or feed >= 0
        if samples:
            r.unseen += 1
            r.sampled_at = (self.calls, index)
        return ScheduledSequence(r.id, known, start, r.pages, r.params, r.seed, samples=samples,
                                 prefill=feed < 0 and (n > 1 or not r.output), feed=feed,
                                 prompt_targets=r.prompt_targets(start, n))

    def _lookup_prefix(self, r: Request) -> None:
        """(Re)admission: take the pages the prefix cache holds for r's tokens, never its last token, nor (as vLLM)
        a position whose prompt log-probabilities it still needs: those come from the logits of its own step, so
        it computes them, and their K/V with them (its pages are offered to the cache as any request's)."""
        if len(r.pages):
            return
        P = self.pool.page_size
        full = (len(r.tokens) - 1) // P
        if r.prompt_logprobs_pending:
            full = min(full, (len(r.prompt_logprobs) - 1) // P)   # positions before the first entry not in
        hashes = page_hashes(r.tokens[: full * P], P)
        r.pages = np.asarray(self.pool.lookup(hashes), np.int32)
        r.hashes = hashes[: len(r.pages)]
        r.computed = r.scheduled = r.cached_tokens = len(r.pages) * P

    def _grow(self, r: Request, n: int) -> bool:
        """Give r the pages that n more tokens need."""
        need = -(-(r.scheduled + n) // self.pool.page_size) - len(r.pages)
        pages = self.pool.allocate(need, r.pages) if need > 0 else []
        if pages is None:
            return False
        if pages:
            r.pages = np.concatenate([r.pages, np.asarray(pages, np.int32)])
        return True

    def _computed(self, r: Request, n: int) -> None:
        """n more tokens of r are in the cache; offer its new full pages to the prefix cache."""
        r.computed += n
        P, done = self.pool.page_size, len(r.hashes)
        if (done + 1) * P <= r.computed:
            new = page_hashes(r.token_slice(done * P, r.computed), P, r.hashes[-1] if r.hashes else None)
            for page, h in zip(r.pages[done:].tolist(), new, strict=False):
                self.pool.register(page, h)
            r.hashes += new

    def _release(self, r: Request) -> None:
        self.pool.release(r.pages.tolist())
        r.pages, r.hashes, r.computed, r.scheduled, r.unseen = NO_PAGES, [], 0, 0, 0
