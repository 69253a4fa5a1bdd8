"""`python -m jaxinfer.serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) on a device mesh.

    python -m jaxinfer.serve                                   # embedded random-weight model, 127.0.0.1:8000
    python -m jaxinfer.serve --mesh tp=8 --model /ckpt/Llama-3.1-8B-Instruct --port 8080 --api-key KEY

Endpoints: POST /v1/completions and /v1/chat/completions (streamed as server-sent events with
"stream": true), GET /v1/models, GET /health, POST /tokenize and /detokenize, GET /tokenizer_info (vLLM's: the
tokenizer's config and chat template), GET /version, GET /metrics (Prometheus). With --api-key (or
JAXINFER_API_KEY), /v1/*, /tokenize, /detokenize and /tokenizer_info need "Authorization: Bearer KEY" (the
scheme in any case). Every error is an OpenAI error body: 400 for a bad request (jaxinfer.serve.openai_api),
401, 404 for an unknown route or model, 405, 413 for a body over --max-request-bytes, 500 for a request that
failed inside the engine, 503 once the engine is dead (/health too). SIGTERM or Ctrl-C: the server stops taking
requests, lets those in flight finish for --grace-period seconds, then aborts the rest, which end normally with
finish_reason "abort" (a stream's last chunk, or a 200 body with the tokens so far), and exits 0. Multi-host:
every process runs this command; process 0 serves HTTP and the others follow its engine loop.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from jaxinfer.cli import add_model_args, load, prepare, served_model_name

MAX_REQUEST_BYTES = 4 << 20   # the default request body limit
ABORT_DRAIN_S = 5.0           # after the grace period, how long aborted requests have to send their last bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.serve", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JAXINFER_API_KEY"),
                   help="required as a Bearer token when set (env JAXINFER_API_KEY)")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds requests in flight may finish after SIGTERM before they are aborted (they then "
                        'end with finish_reason "abort")')
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="larger request bodies are refused with 413 before they are parsed (default: 4 MiB)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="listen at once; each step bucket is compiled when a request first needs it")
    return p.parse_args(argv)


def build_app(llm, model_name: str, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES):
    """The FastAPI application serving `llm` (a jaxinfer.LLM) under `model_name`."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    import jaxinfer
    from jaxinfer.serve.metrics import Metrics
    from jaxinfer.serve.openai_api import (
        APIError,
        ChatCompletionRequest,
        CompletionRequest,
        DetokenizeRequest,
        OpenAIServing,
        TokenizeRequest,
    )

    serving, metrics = OpenAIServing(llm, model_name), Metrics(llm.loop, model_name)
    app = FastAPI(title="jaxinfer", version=jaxinfer.__version__)
    app.state.serving, app.state.metrics = serving, metrics
    guarded = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")
    key = api_key.encode() if api_key else None

    class ErrorResponse(JSONResponse):
        def render(self, content) -> bytes:  # ASCII escapes: a lone surrogate a client sent cannot fail the answer
            return json.dumps(content, separators=(",", ":")).encode()

    def error(e: APIError, headers: dict | None = None) -> JSONResponse:
        return ErrorResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return error(APIError.of_validation(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        """Starlette's own refusals (no such route, a wrong method...) in the OpenAI shape."""
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return error(APIError(message, e.status_code), e.headers)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        return error(APIError(f"internal error: {type(e).__name__}: {e}", 500))

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if key and request.url.path.startswith(guarded):
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key):
                return error(APIError("invalid API key: send Authorization: Bearer <key>", 401,
                                      code="invalid_api_key"))
        return await call_next(request)

    app.add_middleware(BodyLimit, limit=max_request_bytes)   # outermost: before anything reads the body

    async def respond(request: Request, result: Awaitable) -> Response:
        body = await _until_disconnected(request, result)
        if body is None:  # the client left: its requests were aborted, and nobody reads this
            return Response(status_code=499)
        if isinstance(body, dict):
            return JSONResponse(body)
        return StreamingResponse(_guarded(body), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await respond(request, serving.completions(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(request, serving.chat(body))

    @app.get("/v1/models")
    async def models() -> dict:
        return serving.models()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return serving.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return serving.tokenizer_info()

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine can serve; 503 once it failed for good (a supervisor restarts the server)."""
        if llm.loop.dead is not None:
            return error(APIError(f"the engine failed and cannot go on: {llm.loop.dead}", 503))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": jaxinfer.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before it is parsed, from its Content-Length,
    or (chunked, without one) as soon as the bytes read pass the limit; the app's own answer to the body cut
    short is then dropped for the 413."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self.refuse(scope, receive, send)
        read, over, started = 0, False, False

        async def counted():
            nonlocal read, over
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.limit:
                    over = True
                    raise BodyTooLarge
            return message

        async def send_unless_over(message) -> None:
            nonlocal started
            if not over:
                started = True
                await send(message)

        try:
            await self.app(scope, counted, send_unless_over)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self.refuse(scope, receive, send)

    async def refuse(self, scope, receive, send) -> None:
        from fastapi.responses import JSONResponse

        from jaxinfer.serve.openai_api import APIError
        e = APIError(f"the request body is larger than this server's limit of {self.limit} bytes "
                     "(--max-request-bytes)", 413)
        await JSONResponse(e.body(), status_code=413)(scope, receive, send)


class BodyTooLarge(Exception):
    """Raised into the app reading a body over the limit (BodyLimit answers 413)."""


async def _until_disconnected(request, work: Awaitable):
    """`work`'s result, or None if the client disconnects first: then `work` is cancelled (its requests
    aborted)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A failure after the stream has started cannot change the status: it becomes an error event."""
    from jaxinfer.serve.openai_api import failure, sse
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - reported to the client, the server goes on
        yield sse(failure(e).body())
        yield "data: [DONE]\n\n"


def graceful_server(config, abort: Callable[[], None] | None = None):
    """uvicorn's server, except that SIGTERM (or Ctrl-C) ends `run()` after the graceful shutdown, where uvicorn
    would raise the signal again (the process then dies by it): the caller exits 0.

    With `abort` (e.g. EngineLoop.abort_all): when config.timeout_graceful_shutdown runs out, `abort()` ends the
    requests still running, and their responses get ABORT_DRAIN_S more to finish normally (finish_reason
    "abort"); uvicorn would cancel them, cutting their connections."""
    import uvicorn

    class Server(uvicorn.Server):
        grace = config.timeout_graceful_shutdown

        def __init__(self, config):
            super().__init__(config)
            if abort is not None and self.grace is not None:
                config.timeout_graceful_shutdown = self.grace + ABORT_DRAIN_S   # uvicorn's own deadline

        async def _wait_tasks_to_complete(self) -> None:
            if abort is None or self.grace is None:
                return await super()._wait_tasks_to_complete()
            try:
                async with asyncio.timeout(self.grace):
                    return await super()._wait_tasks_to_complete()
            except TimeoutError:
                pass
            logging.getLogger("uvicorn.error").info("grace period over: aborting %d request(s) still running",
                                                    len(self.server_state.tasks))
            abort()
            await super()._wait_tasks_to_complete()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)


@contextlib.contextmanager
def http_server(llm, model_name: str) -> Iterator[str]:
    """build_app for `llm` on uvicorn, in a thread, on 127.0.0.1 and a free port: its URL (benchmarks, tests)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # log_config=None: uvicorn leaves this process's logging set-up alone (warnings still reach stderr)
    server = graceful_server(uvicorn.Config(build_app(llm, model_name), log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bench-http", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise OSError("the HTTP server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        job, mesh, engine_config = prepare(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    try:
        llm, random_weights = load(args, mesh, engine_config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.warmup:  # every process compiles its own executables
        print(f"compiled {llm.warmup()} step buckets", file=sys.stderr)
    if not llm.loop.leader:  # multi-host: process 0 takes the requests, this process follows its loop
        llm.loop.follow()
        return 0
    name = served_model_name(args)
    config = uvicorn.Config(build_app(llm, name, args.api_key, args.max_request_bytes), host=args.host,
                            port=args.port, timeout_graceful_shutdown=args.grace_period, log_level="info")
    graceful_server(config, llm.loop.abort_all).run()
    llm.close()  # aborts what the grace period left, and releases the other processes
    return 0

