"""Batch jobs: a file of OpenAI batch requests in, one result line per request out (vLLM's run_batch).

Input: JSONL, one {"custom_id", "method": "POST", "url": "/v1/completions" or "/v1/chat/completions",
"body": {...}} per line (blank lines are skipped). Every request is handed to the engine at once, so
they are batched together, and each is answered by the same code as the HTTP server (a body's "stream"
is ignored). Output: one line per request, in input order, written as soon as it and every line before
it are done: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}. A
request the API refuses gets its status (400) and OpenAI error body in "response"; a line that is not a
request at all (bad JSON, unknown url) gets "response": null and an "error" saying why.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

from tqdm import tqdm

from jaxinfer.llm import LLM
from jaxinfer.openai_api import APIError, ChatCompletionRequest, CompletionRequest, OpenAIServing, parse

ENDPOINTS = {"/v1/completions": (CompletionRequest, "completions"),
             "/v1/chat/completions": (ChatCompletionRequest, "chat")}


async def answer(serving: OpenAIServing, line: str) -> dict:
    """The result line for one input line."""
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
        request = parse(model, body | {"stream": False})
        response = await getattr(serving, handler)(request)
        return result | {"response": {"status_code": 200, "request_id": request_id, "body": response}}
    except APIError as e:
        return result | {"response": {"status_code": e.status, "request_id": request_id, "body": e.body()}}


async def run_batch(serving: OpenAIServing, lines: list[str], out, progress: tqdm | None = None) -> dict:
    """Answers every line concurrently; writes the results in input order as soon as they are ready."""
    tasks = [asyncio.ensure_future(answer(serving, line)) for line in lines]
    counts = {"requests": len(lines), "succeeded": 0, "failed": 0}
    for task in tasks:  # in input order; later ones keep running meanwhile
        result = await task
        ok = result["response"] is not None and result["response"]["status_code"] == 200
        counts["succeeded" if ok else "failed"] += 1
        out.write(json.dumps(result, ensure_ascii=False) + "\n")
        out.flush()
        if progress is not None:
            progress.update()
    return counts


def run_batch_file(llm: LLM, model_name: str, input_path: str | Path, output_path: str | Path) -> dict:
    """Runs a batch file on `llm`; returns the counts of requests, succeeded and failed."""
    lines = [line for line in Path(input_path).read_text().splitlines() if line.strip()]
    serving = OpenAIServing(llm, model_name)
    with open(output_path, "w") as out, tqdm(total=len(lines), desc="requests", unit="req") as progress:
        return asyncio.run(run_batch(serving, lines, out, progress))
