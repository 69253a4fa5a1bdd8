"""`python -m jaxinfer.serve.fuzz`: malformed and extreme requests against a live OpenAI-compatible server,
beside a healthy stream, checking that no request takes the server down.

    python -m jaxinfer.serve.fuzz                             # embedded random-weight model, 500 requests
    python -m jaxinfer.serve.fuzz --requests 5000 --seed 3
    python -m jaxinfer.serve.fuzz --url http://127.0.0.1:8000 --api-key KEY

A seeded generator (`malformed`) draws requests of every shape a careless or hostile client sends: bodies that
are not JSON or not objects, fields of the wrong type, integers past int32 and int64, NaN and infinities,
empty and huge prompts, token ids outside the vocabulary, odd unicode (lone surrogates, NUL, right-to-left
marks), unknown fields, unknown routes and methods, bodies over the size limit. Every answer must be a 200
(whose stream ends with [DONE]) or a 4xx with an OpenAI error body; meanwhile one healthy greedy stream must
get the tokens it gets alone. Afterwards the server must hold no request and no KV page, and its /metrics must
agree. Prints the answers by status and every violation; exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from jaxinfer.cli import DEFAULT_MODEL_NAME

ROUTES = ("/v1/completions", "/v1/chat/completions")
EXTREME_INTS = (-1, 0, 2**31 - 1, 2**31, 2**32, 2**63, -(2**63) - 1, 10**30, -(10**30))
ODD_TEXT = ("", " ", "\x00", "\ud800", "\u202e\u202d", "🦊" * 50, "a" * 5000, "\n" * 300, "<s></s>", "\\u0000",
            "Ϩ̸̡̞̓", "%s%n{0}", '"}{', "null")
INT_FIELDS = ("max_tokens", "n", "top_k", "seed", "logprobs", "top_logprobs", "max_completion_tokens", "best_of",
              "truncate_prompt_tokens")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
ODD_VALUES = (None, True, False, "7", "", [], {}, [1, 2], {"a": 1}, 1.5, -0.0, 1e308, -1e308, 5e-324)


@dataclass
class Probe:
    """One request to send: method, path, and a JSON body or raw bytes."""

    method: str
    path: str
    body: object = None
    raw: bytes | None = None
    headers: dict = field(default_factory=dict)

    def content(self) -> bytes | None:
        if self.raw is not None:
            return self.raw
        if self.body is None:
            return None
        return json.dumps(self.body, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


def malformed(seed: int, count: int, model: str, vocab_size: int, max_body: int) -> Iterator[Probe]:
    """`count` requests drawn from `seed`: mostly near-valid bodies with one or more fields made extreme or
    malformed, some structurally broken. Valid ones ask for at most a few tokens, so the run stays short."""
    rng = random.Random(seed)

    def prompt() -> object:
        return rng.choice([
            lambda: rng.choice(ODD_TEXT),
            lambda: [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 20))],
            lambda: [rng.choice(EXTREME_INTS + (vocab_size, -1, True))],
            lambda: [[rng.randrange(vocab_size)], []],
            lambda: [],
            lambda: [[]],
            lambda: rng.choice(ODD_VALUES),
            lambda: ["ok", rng.choice(ODD_TEXT)],
            lambda: "hello " * rng.randrange(1, 50),
        ])()

    def messages() -> object:
        return rng.choice([
            lambda: [{"role": "user", "content": rng.choice(ODD_TEXT)}],
            lambda: [],
            lambda: [{}],
            lambda: [{"role": rng.choice(["user", "system", "assistant", "tool", "", "🦊", None])}],
            lambda: [{"role": "user", "content": rng.choice(ODD_VALUES)}],
            lambda: [{"role": "user", "content": [{"type": rng.choice(["text", "image_url", None]), "text": "hi"}]}],
            lambda: rng.choice(ODD_VALUES),
            lambda: [{"role": "user", "content": "hi"}] * rng.randrange(1, 40),
        ])()

    def value(name: str) -> object:
        if name in INT_FIELDS and rng.random() < 0.6:
            return rng.choice(EXTREME_INTS)
        if name in FLOAT_FIELDS and rng.random() < 0.6:
            return rng.choice([float("nan"), float("inf"), -float("inf"), -1.0, 2.0, 1e39, 0.0])
        return rng.choice(ODD_VALUES)

    for _ in range(count):
        roll = rng.random()
        path = rng.choice(ROUTES)
        if roll < 0.05:
            yield Probe("POST", path, raw=rng.choice([b"{", b"\xff\xfe\x00", b"[]", b"null", b'{"model": NaN}',
                                                      b"\x00" * 64, b'{"prompt": "\\ud800"}']))
            continue
        if roll < 0.08:
            yield Probe(rng.choice(["GET", "PUT", "DELETE", "PATCH"]), path, body={})
            continue
        if roll < 0.10:
            yield Probe("POST", rng.choice(["/v2/completions", "/v1/embeddings", "/", "/v1/completions/x",
                                            "/%00", "/v1/models/../../etc"]), body={})
            continue
        if roll < 0.12:
            yield Probe("POST", path, raw=b'{"prompt": "' + b"a" * (max_body + 1) + b'"}',
                        headers={"content-type": "application/json"})
            continue
        body: dict = {"model": model, "max_tokens": rng.randrange(1, 5), "temperature": 0}
        if path == ROUTES[0]:
            body["prompt"] = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 8))]
        else:
            body["messages"] = [{"role": "user", "content": "hi"}]
        for _ in range(rng.randrange(1, 4)):
            what = rng.random()
            if what < 0.3:
                body["prompt" if path == ROUTES[0] else "messages"] = prompt() if path == ROUTES[0] else messages()
            elif what < 0.6:
                name = rng.choice(INT_FIELDS + FLOAT_FIELDS)
                body[name] = value(name)
            elif what < 0.7:
                body["stop"] = rng.choice([rng.choice(ODD_TEXT), [rng.choice(ODD_TEXT)] * rng.randrange(0, 50),
                                           rng.choice(ODD_VALUES)])
            elif what < 0.75:
                body["stop_token_ids"] = [rng.choice(EXTREME_INTS) for _ in range(rng.randrange(0, 4))]
            elif what < 0.8:
                body["model"] = rng.choice([None, "", "gpt-4", 7, model + " "])
            elif what < 0.85:
                body[rng.choice(["tool_choice", "functions", "guided_json", "min_tokens", "response_format",
                                 "logit_bias", "max_token", "🦊"])] = rng.choice(ODD_VALUES)
            elif what < 0.9:
                body["stream"] = rng.choice([True, False, "yes", None])
                body["stream_options"] = rng.choice([None, {"include_usage": True}, {"include_usage": "x"}, 3])
            else:
                body = rng.choice([[body], "body", 3, None, {}])
                break
        yield Probe("POST", path, body=body)


@dataclass
class Outcome:
    statuses: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    engine_requests: int = 0   # choices that reached the engine and ended (each counts once in /metrics)


def check(probe: Probe, status: int, text: str, outcome: Outcome) -> None:
    """Whether one answer keeps the promise: a 200 (a stream ending in [DONE]) or a 4xx with an OpenAI error."""
    outcome.statuses[status] += 1
    where = f"{probe.method} {probe.path} {(probe.content() or b'')[:200]!r}"
    if 400 <= status < 500:
        try:
            error = json.loads(text)["error"]
            assert isinstance(error["message"], str) and error["message"] and "type" in error
        except (ValueError, KeyError, TypeError, AssertionError):
            outcome.violations.append(f"{status} without an OpenAI error body: {where} -> {text[:200]!r}")
        return
    if status != 200:
        outcome.violations.append(f"status {status}: {where} -> {text[:300]!r}")
        return
    if text.startswith("data:"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            outcome.violations.append(f"a stream that does not end with [DONE]: {where}")
            return
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):
            outcome.violations.append(f"a stream with an error event: {where} -> {text[-300:]!r}")
        outcome.engine_requests += len({c["index"] for ch in chunks for c in ch.get("choices", [])
                                        if c.get("finish_reason")})
        return
    outcome.engine_requests += len(json.loads(text)["choices"])


async def send(client: httpx.AsyncClient, probe: Probe, outcome: Outcome) -> None:
    try:
        r = await client.request(probe.method, probe.path, content=probe.content(),
                                 headers={"content-type": "application/json"} | probe.headers)
    except httpx.HTTPError as e:
        outcome.violations.append(f"no answer ({type(e).__name__}: {e}) to {probe.method} {probe.path}")
        return
    check(probe, r.status_code, r.text, outcome)


async def healthy_stream(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> list[str]:
    """The healthy stream's text deltas."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    texts = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["finish_reason"] is None:
                    texts.append(choice["text"])
    return texts


async def fuzz(url: str, model: str, probes: list[Probe], healthy: tuple[list[int], int], api_key: str | None = None,
               concurrency: int = 8) -> tuple[Outcome, list[str]]:
    """Sends `probes` (at most `concurrency` at once) while one healthy stream runs; (outcome, its deltas)."""
    outcome, gate = Outcome(), asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(probe: Probe) -> None:
        async with gate:
            await send(client, probe, outcome)

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:
        stream = asyncio.ensure_future(healthy_stream(client, model, *healthy))
        await asyncio.gather(*(one(p) for p in probes))
        texts = await stream
    outcome.engine_requests += 1   # the healthy stream
    return outcome, texts


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples on the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.serve.fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--url", default=None, help="a running server (default: start one on the embedded model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-body", type=int, default=4 << 20, help="the server's request body limit (bytes)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        print("error: --requests and --concurrency must be at least 1", file=sys.stderr)
        return 2
    if args.url is None:
        from jaxinfer.llm import LLM
        from jaxinfer.random_model import default_model
        from jaxinfer.serve.server import http_server

        llm = LLM(default_model(), max_tokens_per_step=64)
        with http_server(llm, DEFAULT_MODEL_NAME) as url:
            return run(url, DEFAULT_MODEL_NAME, llm.config.vocab_size, args)
    model = httpx.get(f"{args.url}/v1/models", headers={"Authorization": f"Bearer {args.api_key}"}
                      if args.api_key else {}).json()["data"][0]["id"]
    return run(args.url, model, 256, args)


def run(url: str, model: str, vocab_size: int, args: argparse.Namespace) -> int:
    healthy = ([1, 72, 101, 108, 108, 111], 32)
    probes = list(malformed(args.seed, args.requests, model, vocab_size, args.max_body))
    before = metric(url, "jaxinfer:request_success_total")
    outcome, _ = asyncio.run(fuzz(url, model, probes, healthy, args.api_key, args.concurrency))
    ended = metric(url, "jaxinfer:request_success_total") - before
    if ended != outcome.engine_requests:
        outcome.violations.append(f"/metrics counts {ended:.0f} ended requests, the answers {outcome.engine_requests}")
    for gauge in ("jaxinfer:num_requests_running", "jaxinfer:kv_cache_pages_in_use"):
        if metric(url, gauge):
            outcome.violations.append(f"{gauge} is {metric(url, gauge)} after the run")
    print(f"{args.requests} requests: " + ", ".join(f"{n} x {s}" for s, n in sorted(outcome.statuses.items())))
    for v in outcome.violations:
        print(f"VIOLATION {v}")
    return 1 if outcome.violations else 0


if __name__ == "__main__":
    sys.exit(main())
