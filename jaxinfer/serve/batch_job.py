"""Batch jobs: a file of OpenAI batch requests in, one result line per request out (vLLM's run_batch).

Input: JSONL, one {"custom_id", "method": "POST", "url": "/v1/completions" or "/v1/chat/completions",
"body": {...}} per line (blank lines are skipped). Every request is handed to the engine at once, so
they are batched together, and each is answered by the same code as the HTTP server (a body's "stream"
is ignored). Output: one line per request, {"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}. A request the API refuses (or that fails in the engine) gets its status and
OpenAI error body in "response"; one that raises anything else gets a 500 and an "internal_server_error"
body, and the other lines go on; a line that is not a request at all (bad JSON, unknown url) gets
"response": null and an "error" saying why. custom_ids must be unique (results are matched to requests by
them, as in OpenAI's Batch API): a file that repeats one is refused before anything runs.

Order: lines are written in input order, each as soon as it and every line before it are done, and flushed;
every line in the file is one whole JSON object and its newline. SIGINT or SIGTERM stops the job: the
requests still running are aborted, the finished lines not yet written are appended (so those come out of
input order; one whose request ended just as the signal came may be left to redo), and `BatchInterrupted` is
raised. A resumed run appends its lines after those already there, in input order.

Resume (`resume=True`): the requests whose custom_id already has a result line in the output file are
skipped and those lines kept byte for byte; the others are answered and appended. A last line cut short (a
job killed mid-write) is dropped and its request redone; so are the result lines of requests without a
custom_id, which cannot be matched to their request and are therefore always redone. A failed line counts
as done: to retry it, delete its line from the output file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import uuid
from pathlib import Path
from typing import IO

from tqdm import tqdm

from jaxinfer.llm import LLM
from jaxinfer.serve.openai_api import APIError, ChatCompletionRequest, CompletionRequest, OpenAIServing, parse

ENDPOINTS = {"/v1/completions": (CompletionRequest, "completions"),
             "/v1/chat/completions": (ChatCompletionRequest, "chat")}
log = logging.getLogger("jaxinfer")


class BatchInterrupted(Exception):
    """The job was stopped by a signal; `counts` says what the output file got before it stopped."""

    def __init__(self, signum: int, counts: dict):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum, self.counts = signum, counts


async def answer(serving: OpenAIServing, line: str) -> dict:
    """The result line for one input line. Cancelling it aborts its engine requests."""
    result = {"id": f"batch-{uuid.uuid4().hex}", "custom_id": None, "response": None, "error": None}
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        return result | {"error": {"code": "invalid_json", "message": f"the line is not JSON: {e}"}}
    if not isinstance(item, dict):
        return result | {"error": {"code": "invalid_request", "message": "a line must be a JSON object"}}
    result["custom_id"] = item.get("custom_id")
    url, method, body = item.get("url"), item.get("method", "POST"), item.get("body")
    if url not in ENDPOINTS or method != "POST" or not isinstance(body, dict):
        return result | {"error": {"code": "invalid_request", "message":
                                   f"a line needs method POST, a url among {sorted(ENDPOINTS)} and a JSON object "
                                   f"body; got method {method!r}, url {url!r}"}}
    model, handler = ENDPOINTS[url]
    request_id = f"{result['id']}-request"
    try:
        request = parse(model, {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False})
        response = await getattr(serving, handler)(request)
        return result | {"response": {"status_code": 200, "request_id": request_id, "body": response}}
    except APIError as e:
        return result | {"response": {"status_code": e.status, "request_id": request_id, "body": e.body()}}
    except Exception as e:  # noqa: BLE001 - this line's failure alone: a 500 line, the others go on
        log.error("batch request %r failed", result["custom_id"], exc_info=e)
        body = APIError(f"the request failed: {type(e).__name__}: {e}", 500).body()
        return result | {"response": {"status_code": 500, "request_id": request_id, "body": body}}


async def run_batch(serving: OpenAIServing, lines: list[str], out: IO[str], progress: tqdm | None = None) -> dict:
    """Answers every line concurrently; writes the results in input order as soon as they are ready. On SIGINT or
    SIGTERM, aborts the rest, writes the finished lines not yet written and raises BatchInterrupted."""
    tasks = [asyncio.ensure_future(answer(serving, line)) for line in lines]
    counts = {"requests": len(lines), "succeeded": 0, "failed": 0}
    written: set[int] = set()

    def write(i: int) -> None:
        result = tasks[i].result()
        ok = result["response"] is not None and result["response"]["status_code"] == 200
        counts["succeeded" if ok else "failed"] += 1
        out.write(json.dumps(result, ensure_ascii=False) + "\n")
        out.flush()
        written.add(i)
        if progress is not None:
            progress.update()

    with _signals() as stop:
        for i, task in enumerate(tasks):  # in input order; later ones keep running meanwhile
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                break
            write(i)
        else:
            return counts
        for task in tasks:
            task.cancel()  # aborts its engine requests; a finished task keeps its result
        await asyncio.gather(*tasks, return_exceptions=True)
        for i, task in enumerate(tasks):
            if i not in written and not task.cancelled() and task.exception() is None:
                write(i)
        raise BatchInterrupted(stop.result(), counts)


class _signals:
    """A future that SIGINT or SIGTERM completes with the signal's number, while in the block. Outside the main
    thread signals cannot be caught here, and keep their handlers."""

    def __enter__(self) -> asyncio.Future:
        self.loop, self.caught = asyncio.get_running_loop(), []
        self.stop = self.loop.create_future()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.loop.add_signal_handler(sig, lambda s=sig: self.stop.done() or self.stop.set_result(s))
            except (ValueError, RuntimeError, NotImplementedError):
                break
            self.caught.append(sig)
        return self.stop

    def __exit__(self, *exc) -> None:
        for sig in self.caught:
            self.loop.remove_signal_handler(sig)


def _key(line: str | bytes) -> str | None:
    """A line's custom_id, as JSON text (any JSON value is hashable so), or None where it has none."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError:
        return None
    cid = item.get("custom_id") if isinstance(item, dict) else None
    return None if cid is None else json.dumps(cid, sort_keys=True)


def read_requests(path: str | Path) -> list[str]:
    """The request lines of a batch file, blank lines left out; ValueError naming a custom_id that appears twice."""
    lines, seen = [], {}
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        key = _key(line)
        if key is not None:
            if key in seen:
                raise ValueError(f"{path}: custom_id {key} is on lines {seen[key]} and {n}; custom_ids must be "
                                 "unique (results are matched to requests by them)")
            seen[key] = n
        lines.append(line)
    return lines


def answered(path: str | Path) -> set[str]:
    """The custom_ids (as `_key` gives them) the output file at `path` already has a result line for. A last line
    without its newline (cut short) and the lines without a custom_id (which cannot be matched to their
    request) are removed from the file, which is rewritten atomically; the other lines are kept byte for byte.
    ValueError for a whole line that is not a result: this is not an output file to append to."""
    path = Path(path)
    if not path.exists():
        return set()
    *complete, tail = path.read_bytes().split(b"\n")
    keep, done = [], set()
    for n, raw in enumerate(complete, 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except json.JSONDecodeError:
            item = None
        if not isinstance(item, dict) or "response" not in item or "custom_id" not in item:
            raise ValueError(f"{path}: line {n} is not a batch result line; fix or remove it before resuming")
        key = _key(raw)
        if key is not None and key not in done:
            done.add(key)
            keep.append(raw)
    if tail or len(keep) < len(complete):
        if tail:
            log.warning("%s: dropping its last line, cut short (%d bytes); its request is redone", path, len(tail))
        tmp = path.with_name(path.name + ".resume-tmp")
        tmp.write_bytes(b"".join(raw + b"\n" for raw in keep))
        os.replace(tmp, path)
    return done


def run_batch_file(llm: LLM, model_name: str, input_path: str | Path, output_path: str | Path,
                   resume: bool = False) -> dict:
    """Runs a batch file on `llm`; returns the counts of requests, succeeded and failed (and with `resume`, those
    skipped as already answered). Without `resume` the output file is overwritten. Raises BatchInterrupted on
    SIGINT or SIGTERM (its counts say what was written), ValueError for a repeated custom_id."""
    lines = read_requests(input_path)
    done = answered(output_path) if resume else set()
    todo = [line for line in lines if _key(line) not in done]
    serving = OpenAIServing(llm, model_name)

    def whole(counts: dict) -> dict:
        counts["requests"] = len(lines)
        if resume:
            counts["skipped"] = len(lines) - len(todo)
        return counts

    with (open(output_path, "a" if resume else "w", encoding="utf-8") as out,
          tqdm(total=len(lines), initial=len(lines) - len(todo), desc="requests", unit="req") as progress):
        try:
            return whole(asyncio.run(run_batch(serving, todo, out, progress)))
        except BatchInterrupted as e:
            whole(e.counts)
            raise
