"""One thread owns the engine; any number of callers share it.

The engine (jaxinfer.engine.core) is single-threaded: a step donates the KV pool, and the schedulers' state
changes inside it. `EngineLoop` gives it one owner, a thread that runs steps while requests it was given
are unfinished and ends when there are none. Callers, from any thread or asyncio task, submit requests,
abort them and score sequences through a thread-safe inbox, applied between steps, and receive each
request's tokens on its own stream (`RequestStream`, iterable or async-iterable). Abandoning a stream
(leaving its iteration, or dropping it) aborts its request.

Multi-host: process 0's inbox is the only one read. Each turn of its loop broadcasts what it took from
the inbox to every process, and every process applies the same operations before the same step, so all
schedulers make the same decisions. Followers run the loop until process 0 closes it (`follow()`); calls
a follower makes itself (the same calls on every process, as `python -m jaxinfer.launch` makes them) are
matched to process 0's by request id and receive their tokens too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import jax
import numpy as np

from jaxinfer.distributed import broadcast_object
from jaxinfer.engine.core import Completion, Engine, RequestError
from jaxinfer.engine.scheduler import Request
from jaxinfer.sampling import SamplingParams

_DONE = object()    # the end of a stream's events


class EngineDead(RuntimeError):
    """The engine failed in a way it could not recover from: nothing more can be served by this process."""

HEARTBEAT_S = 1.0   # multi-host: an idle process 0 still broadcasts (an empty turn) this often


class RequestStream:
    """One request's tokens as they are produced: iterate (or `async for`) for (token id, text delta);
    `result()` (or `await aresult()`) for the whole Completion. Leaving the iteration early aborts the
    request. With logprobs requested, `logprobs[i]` is token i's entry, there before the token is; with
    prompt_logprobs, `prompt_logprobs` and `prompt_ranks` are the prompt's (Completion's), there before the first
    token is."""

    def __init__(self, loop: EngineLoop, request_id: str, aio: asyncio.AbstractEventLoop | None = None):
        self.id, self._loop, self._aio = request_id, loop, aio
        self._events: queue.SimpleQueue | asyncio.Queue = queue.SimpleQueue() if aio is None else asyncio.Queue()
        self.completion: Completion | None = None
        self.error: BaseException | None = None
        self.logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] = []
        self.prompt_ranks: list[int | None] = []

    def __iter__(self) -> Iterator[tuple[int, str]]:
        if self._aio is not None:
            raise TypeError("this stream was submitted for asyncio: use `async for`")
        try:
            while (event := self._events.get()) is not _DONE:
                yield event
            self._raise()
        finally:
            self._abandon()

    async def __aiter__(self) -> AsyncIterator[tuple[int, str]]:
        if self._aio is None:
            raise TypeError("this stream was submitted for threads: use `for`")
        try:
            while (event := await self._events.get()) is not _DONE:
                yield event
            self._raise()
        finally:
            self._abandon()

    def result(self) -> Completion:
        """Waits for the request to end; raises what failed it (a RequestError for a refused request)."""
        for _ in self:
            pass
        return self.completion

    async def aresult(self) -> Completion:
        async for _ in self:
            pass
        return self.completion

    def _abandon(self) -> None:
        if self.completion is None and self.error is None:
            self._loop.abort(self.id)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    # called by the loop's thread
    def _put(self, event: object) -> None:
        if self._aio is None:
            self._events.put(event)
            return
        try:
            self._aio.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass

    def _token(self, r: Request, token: int, delta: str) -> None:
        if r.params.logprobs is not None:
            self.logprobs.append(r.logprobs[-1])
        if r.params.prompt_logprobs is not None and not self.prompt_logprobs:   # the prompt's, complete by now
            self.prompt_logprobs, self.prompt_ranks = list(r.prompt_logprobs), list(r.prompt_ranks)
        self._put((token, delta))

    def _end(self, r: Request | None, error: BaseException | None = None) -> None:
        if r is not None:
            self.completion = Completion.of(r)
        self.error = error
        self._put(_DONE)


class EngineLoop:
    """The engine's owner thread, its inbox, and the streams of the requests it serves."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.lock = threading.Lock()          # held while the engine is in use: applying the inbox and a step
        self.on_end: Callable[[Request], None] | None = None  # told of every request that ends (e.g. metrics)
        self.leader = jax.process_index() == 0
        self.multihost = jax.process_count() > 1
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}                      # submitted here, not yet ended
        self._scores: dict[str, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self.dead: BaseException | None = None   # what stopped the engine for good (a supervisor restarts us)

    # ---- callers (any thread) --------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
               asynchronous: bool = False) -> RequestStream:
        """Queue a request (checked here first: a prompt that can never be served raises RequestError now).
        asynchronous: the stream is read with `async for` in the calling asyncio event loop."""
        return self.submit_all([prompt], [params], [request_id], asynchronous)[0]

    def submit_all(self, prompts: list[list[int]], params: list[SamplingParams],
                   request_ids: list[str | None] | None = None, asynchronous: bool = False) -> list[RequestStream]:
        """Queue requests together: all are checked first, and all join the same step."""
        if self.dead is not None:
            raise EngineDead(f"the engine cannot go on after a failure it could not recover from: {self.dead}")
        for prompt, p in zip(prompts, params, strict=True):
            self.engine.check_request(prompt, p)
        aio = asyncio.get_running_loop() if asynchronous else None
        streams = [RequestStream(self, rid or f"loop-{next(self._ids)}", aio)
                   for rid in request_ids or [None] * len(prompts)]
        with self._start_lock:
            if self._closed:
                raise RuntimeError("the engine loop is closed")
            for s in streams:
                if s.id in self._streams:
                    raise RequestError(f"request id {s.id!r} is already in use")
            self._streams.update((s.id, s) for s in streams)
        self._send(("add", [(s.id, p, sp) for s, p, sp in zip(streams, prompts, params, strict=True)]))
        return streams

    def abort(self, request_id: str) -> None:
        """Stop a request between steps (from any thread, a token callback included)."""
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        """Stop every unfinished request between steps; each stream ends with its Completion, finish_reason
        "abort" (a server's shutdown once its grace period is over)."""
        self._send(("abort_all",))

    def score(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """Engine.score between steps."""
        key, future = f"score-{next(self._ids)}", concurrent.futures.Future()
        self._scores[key] = future
        self._send(("score", key, sequences))
        return future.result()

    def close(self) -> None:
        """Stop serving: unfinished requests are aborted and the thread ends (on every process, when
        process 0 closes). Later submits raise RuntimeError."""
        with self._start_lock:
            self._closed = True
        self._send(("stop",))
        self.join()

    def follow(self) -> None:
        """Run this process's share of the loop until process 0 closes it (multi-host followers)."""
        self._kick()
        self.join()

    def join(self) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def running(self) -> int:
        """Requests the loop is serving (submitted, not yet ended)."""
        return len(self._streams)

    # ---- the loop's thread -----------------------------------------------------------------------
    def _send(self, op: tuple) -> None:
        if self.leader:  # a follower's own calls are matched to process 0's, which carry them
            self._inbox.put(op)
        self._kick()

    def _kick(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        """Steps while there is work. A single process's thread then ends (an idle loop holds no thread, so
        an LLM nobody uses any more is freed with its device buffers) and the next submit starts another;
        a multi-host loop runs until it is closed."""
        while True:
            ops = self._take()
            with self.lock:
                stop = self._apply(ops)
                if self.engine.requests:
                    self._step()
                    continue
            if stop:
                return
            if not self.multihost:
                with self._start_lock:
                    if self._inbox.empty():
                        self._thread = None
                        return

    def _take(self) -> list[tuple]:
        """This turn's operations: process 0's inbox, broadcast to every process under multi-host."""
        if not self.leader:
            return broadcast_object(None)
        ops = []
        if self.multihost and not self.engine.requests:  # idle: wait for work, but keep the followers posted
            try:
                ops.append(self._inbox.get(timeout=HEARTBEAT_S))
            except queue.Empty:
                pass
        while True:
            try:
                ops.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        return broadcast_object(ops) if self.multihost else ops

    def _apply(self, ops: list[tuple]) -> bool:
        """Apply the turn's operations in order; True if the loop is to stop."""
        for kind, *args in ops:
            if kind == "add":
                for request_id, prompt, params in args[0]:
                    stream = self._streams.get(request_id)
                    if self.dead is not None:
                        self._end(request_id, None, EngineDead(f"the engine failed and could not recover: {self.dead}"))
                        continue
                    try:
                        self.engine.add_request(prompt, params, request_id,
                                                on_token=stream._token if stream is not None else None)
                    except Exception as e:  # noqa: BLE001 - a refusal (RequestError) or a failure: its caller's
                        if stream is not None:
                            self._end(request_id, None, e)
            elif kind == "abort":
                entry = self.engine.requests.get(args[0])
                if entry is not None and self.engine.abort(args[0]):
                    self._end(args[0], entry[0])
            elif kind == "score":
                key, sequences = args
                future = self._scores.pop(key, None)
                try:
                    result = self.engine.score(sequences)
                except Exception as e:  # noqa: BLE001 - the caller gets the failure, the loop goes on
                    if future is not None:
                        future.set_exception(e)
                else:
                    if future is not None:
                        future.set_result(result)
            elif kind in ("abort_all", "stop"):
                for request_id, (r, _) in list(self.engine.requests.items()):
                    self.engine.abort(request_id)
                    self._end(request_id, r)
                if kind == "stop":
                    return True
        return False

    def _end(self, request_id: str, r: Request | None, error: BaseException | None = None) -> None:
        if r is not None and self.on_end is not None:
            self.on_end(r)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._end(r if error is None else None, error)

    def _step(self) -> None:
        """One engine step. A request that failed in it ends with its error; the engine restores the others itself
        (jaxinfer.engine.core). A failure that escapes the step is recovered from the same way; if even that fails,
        the engine is dead: every caller gets the failure, and later submits raise EngineDead."""
        try:
            try:
                finished = self.engine.step()
            except Exception as e:  # noqa: BLE001 - the engine restarts what it can
                finished = self.engine.recover(e)
        except Exception as e:  # noqa: BLE001 - nothing more can run here: say so, end every stream
            self.dead = e
            for request_id in list(self._streams):
                self._end(request_id, None, EngineDead(f"the engine failed and could not recover: {e}"))
            self.engine.requests.clear()
            return
        for r in finished:
            self._end(r.id, r, r.error)
