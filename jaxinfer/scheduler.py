"""Host-side continuous batching for one data-parallel replica (vLLM v1's scheduler, in small).

Every step has a token budget. Running requests go first, oldest first: a decode takes one token, a
prefill the next chunk of its prompt that fits. When pages run out, the newest running request is
preempted: its pages are released and it goes back to the front of the queue, to be recomputed later
from its prompt and the tokens it already produced (so its output is what it would have been). Waiting
requests are admitted while budget, sequence slots and pages allow; their prompt's full pages are
looked up in the prefix cache first, and only the rest is prefilled.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

from jaxinfer.page_pool import PagePool, page_hashes
from jaxinfer.sampling import SamplingParams
from jaxinfer.tokenizer import IncrementalDetokenizer


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
    pages: list[int] = dataclasses.field(default_factory=list)
    hashes: list[int] = dataclasses.field(default_factory=list)  # chained hashes of its full pages so far
    computed: int = 0                            # tokens whose keys/values are in the cache
    cached_tokens: int = 0                       # prompt tokens served from the prefix cache (last admission)
    finish_reason: str | None = None
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        return len(self.prompt) + len(self.output) - self.computed

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    def add_token(self, token: int) -> None:
        """Append a sampled token, stream it, and decide whether the request is finished."""
        self.output.append(token)
        self.token_times.append(time.perf_counter())
        delta = self.detokenizer.add(token) if self.detokenizer is not None else ""
        if token in self.stop_ids or (self.detokenizer is not None and self.detokenizer.stopped):
            self.finish_reason = "stop"
        elif len(self.output) >= self.budget:
            self.finish_reason = "length"
        if self.finish_reason and self.detokenizer is not None:
            delta += self.detokenizer.finish()
        if self.on_token is not None:
            self.on_token(self, token, delta)


class Replica:
    """The requests and pages of one dp replica."""

    def __init__(self, pool: PagePool, max_seqs: int, max_tokens: int):
        self.pool, self.max_seqs, self.max_tokens = pool, max_seqs, max_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's (request, number of tokens to compute) pairs."""
        P, budget, scheduled, preempted = self.pool.page_size, self.max_tokens, [], False
        for r in list(self.running):
            if r not in self.running or budget == 0:
                continue
            n = min(r.pending, budget)
            while r in self.running and not self._grow(r, n):
                preempted = True
                self.preempt(self.running[-1])
            if r in self.running:
                scheduled.append((r, n))
                budget -= n
        while self.waiting and not preempted and budget and len(self.running) < self.max_seqs:
            r = self.waiting[0]
            if not r.pages:  # (re)admission: take what the prefix cache has, never the last token
                full = (len(r.tokens) - 1) // P
                r.hashes = page_hashes(r.tokens[: full * P], P)
                r.pages = self.pool.lookup(r.hashes)
                r.hashes = r.hashes[: len(r.pages)]
                r.computed = r.cached_tokens = len(r.pages) * P
            n = min(r.pending, budget)
            if not self._grow(r, n):
                break
            self.waiting.popleft()
            self.running.append(r)
            scheduled.append((r, n))
            budget -= n
        return scheduled

    def _grow(self, r: Request, n: int) -> bool:
        """Give r the pages that n more tokens need."""
        need = -(-(r.computed + n) // self.pool.page_size) - len(r.pages)
        pages = self.pool.allocate(need) if need > 0 else []
        if pages is None:
            return False
        r.pages += pages
        return True

    def computed(self, r: Request, n: int) -> None:
        """After the device step: n more tokens of r are in the cache; offer its new full pages."""
        r.computed += n
        P, done = self.pool.page_size, len(r.hashes)
        if (done + 1) * P <= r.computed:
            new = page_hashes(r.tokens[done * P: r.computed], P, r.hashes[-1] if r.hashes else None)
            for page, h in zip(r.pages[done:], new, strict=False):
                self.pool.register(page, h)
            r.hashes += new

    def preempt(self, r: Request) -> None:
        self._release(r)
        self.running.remove(r)
        self.waiting.appendleft(r)
        self.preemptions += 1

    def finish(self, r: Request) -> None:
        self._release(r)
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)

    def _release(self, r: Request) -> None:
        self.pool.release(r.pages)
        r.pages, r.hashes, r.computed = [], [], 0
