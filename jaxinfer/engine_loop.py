"""One thread owns the engine; any number of callers share it.

The engine (jaxinfer.engine) is single-threaded: a step donates the KV pool, and the schedulers' state
changes inside it. `EngineLoop` gives it one owner, a thread that runs steps while requests it was given
are unfinished and ends when there are none. Callers, from any thread, submit requests and abort them
through a thread-safe inbox, applied between steps, and receive each request's tokens on its own
queue (`RequestStream`). Abandoning a stream (closing its iterator, or dropping it) aborts its request.
Scoring (`score`) takes the same lock as a step, so it never runs inside one.

Under several processes (multi-host) every process runs the same loop on the same calls, as with the
synchronous API: the requests must reach each process in the same order.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator

import numpy as np

from jaxinfer.engine import Completion, Engine, RequestError
from jaxinfer.sampling import SamplingParams
from jaxinfer.scheduler import Request

_DONE = object()  # the end of a stream's events


class RequestStream:
    """One request's tokens as they are produced: iterate for (token id, text delta); `result()` waits for
    the whole Completion. Leaving the iteration early aborts the request."""

    def __init__(self, loop: EngineLoop, request_id: str):
        self.id, self._loop = request_id, loop
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.completion: Completion | None = None
        self.error: BaseException | None = None

    def __iter__(self) -> Iterator[tuple[int, str]]:
        try:
            while (event := self._events.get()) is not _DONE:
                yield event
            self._raise()
        finally:
            if self.completion is None and self.error is None:
                self._loop.abort(self.id)

    def result(self) -> Completion:
        """Waits for the request to end; raises what failed it (a RequestError for a refused request)."""
        for _ in self:
            pass
        return self.completion

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    # called by the loop's thread
    def _token(self, _: Request, token: int, delta: str) -> None:
        self._events.put((token, delta))

    def _end(self, r: Request | None, error: BaseException | None = None) -> None:
        if r is not None:
            self.completion = Completion.of(r)
        self.error = error
        self._events.put(_DONE)


class EngineLoop:
    """The engine's owner thread, its inbox, and the streams of the requests it serves."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.lock = threading.Lock()          # held while the engine is in use: a step, an inbox, a score
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue a request (checked here first: a prompt that can never be served raises RequestError now)."""
        return self.submit_all([prompt], [params], [request_id])[0]

    def submit_all(self, prompts: list[list[int]], params: list[SamplingParams],
                   request_ids: list[str | None] | None = None) -> list[RequestStream]:
        """Queue requests together: all are checked first, and all join the same step."""
        for prompt in prompts:
            self.engine.check_prompt(prompt)
        streams = [RequestStream(self, rid or f"loop-{next(self._ids)}")
                   for rid in request_ids or [None] * len(prompts)]
        self._inbox.put(("add", list(zip(streams, prompts, params, strict=True))))
        self._kick()
        return streams

    def abort(self, request_id: str) -> None:
        """Stop a request between steps (from any thread, a token callback included)."""
        self._inbox.put(("abort", request_id))
        self._kick()

    def score(self, sequences: list[list[int]]) -> list[np.ndarray]:
        with self.lock:
            return self.engine.score(sequences)

    @property
    def running(self) -> int:
        """Requests the loop is serving (submitted, not yet ended)."""
        return len(self._streams) + self._inbox.qsize()

    def _kick(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        """Steps while there is work; then the thread ends (an idle loop holds no thread, so an LLM nobody
        uses any more is freed with its device buffers), and the next submit starts another."""
        while True:
            with self.lock:
                self._apply_inbox()
                if self._streams:
                    self._step()
                    continue
            with self._start_lock:
                if self._inbox.empty():
                    self._thread = None
                    return

    def _apply_inbox(self) -> None:
        while True:
            try:
                kind, *args = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                for stream, prompt, params in args[0]:
                    try:
                        self.engine.add_request(prompt, params, stream.id, on_token=stream._token)
                    except RequestError as e:
                        stream._end(None, e)
                        continue
                    self._streams[stream.id] = stream
            elif (stream := self._streams.pop(args[0], None)) is not None:
                r = self.engine.requests[stream.id][0]
                self.engine.abort(stream.id)
                stream._end(r)

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as e:  # noqa: BLE001 - every waiting caller gets the failure, the loop goes on
            for request_id, stream in list(self._streams.items()):
                self.engine.abort(request_id)
                stream._end(None, e)
            self._streams.clear()
            return
        for r in finished:
            stream = self._streams.pop(r.id, None)
            if stream is not None:
                stream._end(r)
