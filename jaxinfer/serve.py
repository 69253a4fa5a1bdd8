"""`python -m jaxinfer.serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) on a device mesh.

    python -m jaxinfer.serve                                   # embedded random-weight model, 127.0.0.1:8000
    python -m jaxinfer.serve --mesh tp=8 --model /ckpt/Llama-3.1-8B-Instruct --port 8080 --api-key KEY

Endpoints: POST /v1/completions and /v1/chat/completions (streamed as server-sent events with
"stream": true), GET /v1/models, GET /health, POST /tokenize and /detokenize, GET /version, GET /metrics
(Prometheus). With --api-key (or JAXINFER_API_KEY), /v1/*, /tokenize and /detokenize need
"Authorization: Bearer KEY". SIGTERM or Ctrl-C: the server stops taking requests, lets those in flight
finish for --grace-period seconds, aborts the rest, and exits 0. Multi-host: every process runs this
command; process 0 serves HTTP and the others follow its engine loop.
"""

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable

from jaxinfer.launch import add_model_args, prepare, served_model_name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.serve", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JAXINFER_API_KEY"),
                   help="required as a Bearer token when set (env JAXINFER_API_KEY)")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds requests in flight may finish after SIGTERM before they are aborted")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="listen at once; each step bucket is compiled when a request first needs it")
    return p.parse_args(argv)


def build_app(llm, model_name: str, api_key: str | None = None):
    """The FastAPI application serving `llm` (a jaxinfer.LLM) under `model_name`."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    import jaxinfer
    from jaxinfer.metrics import Metrics
    from jaxinfer.openai_api import (
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
    guarded = ("/v1/", "/tokenize", "/detokenize")

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return error(APIError.of_validation(e))

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key and request.url.path.startswith(guarded):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error(APIError("invalid API key: send Authorization: Bearer <key>", 401,
                                      code="invalid_api_key"))
        return await call_next(request)

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

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": jaxinfer.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


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
    from jaxinfer.openai_api import APIError, sse
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - reported to the client, the server goes on
        yield sse(APIError(f"generation failed: {e}", 500).body())
        yield "data: [DONE]\n\n"


def graceful_server(config):
    """uvicorn's server, except that SIGTERM (or Ctrl-C) ends `run()` after the graceful shutdown, where uvicorn
    would raise the signal again (the process then dies by it): the caller exits 0."""
    import uvicorn

    class Server(uvicorn.Server):
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        job, mesh, engine_config = prepare(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from jaxinfer.launch import load

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
    config = uvicorn.Config(build_app(llm, name, args.api_key), host=args.host, port=args.port,
                            timeout_graceful_shutdown=args.grace_period, log_level="info")
    graceful_server(config).run()
    llm.close()  # aborts what the grace period left, and releases the other processes
    return 0


if __name__ == "__main__":
    sys.exit(main())
