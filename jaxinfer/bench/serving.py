"""`python -m jaxinfer.bench.serving`: serving throughput, latency and KV-cache utilisation (vLLM's figures).

    python -m jaxinfer.bench.serving                        # random-weight BENCH_100M, 32 requests, all at t=0
    python -m jaxinfer.bench.serving --preset small --request-rate 4 --json
    python -m jaxinfer.bench.serving --mesh dp=2 --num-pages 64 --max-tokens-per-step 128
    python -m jaxinfer.bench.serving --http --preset small  # in-process streams vs the same over HTTP
    python -m jaxinfer.bench.serving --url http://127.0.0.1:8000 --num-requests 64 --concurrency 16

Workload: --num-requests requests; prompt and output lengths uniform (inclusive) over the two ranges, prompt
tokens uniform over the vocabulary, all from --seed. Arrivals are in wall time, as in vLLM's benchmark: a
Poisson process of --request-rate requests/s (exponential gaps from the same seed; inf = all at t=0). The
driver adds every request whose arrival time has passed before each engine step, while the engine runs; a
request's arrival is its scheduled time, so waiting for the step boundary counts in its latency. Decoding is
greedy with ignore_eos, so each request generates exactly its drawn output length.
A warm-up pass first serves the same lengths and arrivals with other tokens (seed + 1), then the prefix cache
is emptied, so the measured pass schedules as the warm-up did and reuses its compiled buckets. With a finite
rate, batches depend on the clock (and compile stalls skew the first pass), so a second warm-up (seed + 2)
runs; compilations_measured counts any bucket still new (0 with --request-rate inf, where the clock is moot)
and compile_seconds_measured the stall they added to the latencies.

Figures (measured pass only; percentiles are numpy's linear interpolation):
- duration_s: first arrival (t=0) to last token. request/output/total throughput = requests,
  output tokens, and prompt + output tokens over duration_s.
- TTFT = time of first token - arrival. TPOT = (time of last token - time of first token) / (output - 1), over
  requests with output >= 2. ITL = gaps between consecutive tokens of one request, all requests pooled.
- prefix_cache_hits / queries: full prompt pages found / looked up in the prefix cache (random prompts share
  none, so hits are re-admissions of preempted requests). preemptions: requests evicted for lack of pages.
- KV utilisation, sampled after every step with running requests, then averaged over those steps:
  paged = sum(computed) / (distinct pages held by running requests x page_size);
  contiguous = sum(computed) / (running requests x (max prompt len + max output len)), i.e. what a static-batch
  engine reserving the maximum length per sequence would use. paged_over_contiguous = mean paged / mean
  contiguous: how many more requests the same KV memory holds paged. peak_pages_in_use vs pool_pages (all
  replicas; cached pages no running request references are not in use).
- page_hash_us: host time to key one full page for the prefix cache (chained SHA-256 over 16-token pages
  of a 4,096-token prompt, best of 5), the price of collision-resistant keys.

HTTP load (--http, --url): what the HTTP layer costs. --http loads the model as above, starts the
OpenAI-compatible server (jaxinfer.serve.server.build_app on uvicorn, in a thread of this process, on 127.0.0.1 and a
free port), and serves the same workload (same prompts as token ids, output lengths and arrivals; greedy,
ignore_eos, max_tokens = the drawn length) two ways, each with --concurrency streaming clients (default: one
per request), asyncio tasks: in-process, of this process, each reading the token stream of
llm.loop.submit; over HTTP, of a second process (as real clients are remote: their JSON parsing does not
hold the server's GIL, though on a small machine it shares the cores), each POSTing /v1/completions with
the prompt ids and "stream": true (one httpx.AsyncClient per pass, so connecting counts) and reading the
server-sent events, one token per chunk whose choice has no finish_reason. Each way gets its own warm-up
pass(es) with other tokens, as above, both before either is measured, and the prefix cache is emptied
after every pass. Clients submit one by one while the engine runs, so batches depend on the clock even
at --request-rate inf: compilations_measured and compile_seconds_measured show any bucket still new, and
the stall it added to the latencies.
--url drives a running server instead (the first model of its GET /v1/models; --api-key if it needs one):
HTTP figures only; its prefix cache cannot be emptied (random prompts share no pages anyway), and prompt
ids are drawn below --vocab-size (default 256, which any real vocabulary covers: the API does not tell a
model's vocabulary size).
Figures, per way (what a client sees, so they include the client's own time):
- a request's arrival is when its client sends it: its scheduled time, or later if all clients are busy;
  each token's time is when the client receives it.
- duration_s: first arrival (t=0) to the last token received; request / output throughput = requests /
  output tokens over it. TTFT = first token - arrival; ITL = gaps between consecutive tokens of one
  request, all requests pooled.
- http_over_in_process: throughput_ratio = HTTP / in-process output throughput (the same tokens, so also
  in-process duration / HTTP duration); ttft_median_diff_ms and itl_median_diff_ms = HTTP - in-process
  medians. outputs_match: every request's text is the same both ways (greedy decoding).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import multiprocessing
import sys
import time
import timeit
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from jaxinfer.cli import DTYPES, bench_command
from jaxinfer.config import EngineConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.serving", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the random-weight --preset)")
    p.add_argument("--preset", default="bench", choices=["bench", "small"],
                   help="random-weight model when --model is absent: bench = BENCH_100M (~125M), small = DEFAULT")
    p.add_argument("--mesh", default="", help='e.g. "tp=2" or "dp=2" (default: one device)')
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="default float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second of wall time (default inf: all arrive at t=0)")
    p.add_argument("--prompt-len-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len-range", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    way = p.add_mutually_exclusive_group()
    way.add_argument("--http", action="store_true",
                     help="serve the workload in-process and over HTTP (a server in this process), side by side")
    way.add_argument("--url", default=None,
                     help="drive the OpenAI-compatible server at this URL, e.g. http://127.0.0.1:8000 (HTTP only)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="--http/--url: streaming clients (default: one per request)")
    p.add_argument("--vocab-size", type=int, default=256, help="--url: prompt ids are drawn below this")
    p.add_argument("--api-key", default=None, help="--url: sent as Authorization: Bearer KEY")
    EngineConfig.add_cli_args(p)
    return p.parse_args(argv)


Work = list[tuple[float, list[int], int]]


def workload(args: argparse.Namespace, vocab: int, seed: int) -> Work:
    """(arrival offset s, prompt ids, output length) per request: lengths and arrivals from --seed, tokens
    from `seed`, so the warm-up has the measured pass's shape with other tokens."""
    rng, tok = np.random.default_rng(args.seed), np.random.default_rng(seed)
    n, (p0, p1), (o0, o1) = args.num_requests, args.prompt_len_range, args.output_len_range
    prompt_lens, output_lens = rng.integers(p0, p1 + 1, n), rng.integers(o0, o1 + 1, n)
    gaps = rng.exponential(1 / args.request_rate, n) if math.isfinite(args.request_rate) else np.zeros(n)
    gaps[0] = 0.0
    return [(float(t), tok.integers(0, vocab, int(lp)).tolist(), int(lo))
            for t, lp, lo in zip(np.cumsum(gaps), prompt_lens, output_lens, strict=True)]


def serve(engine, work: Work) -> dict:
    """Drive the engine through one workload; returns the requests, duration and per-step KV samples."""
    from jaxinfer.sampling import SamplingParams

    pending, requests, samples = list(reversed(work)), [], []
    before, compiled = engine.stats.copy(), engine.compilations
    hits, queries = (sum(getattr(r.pool, a) for r in engine.schedulers) for a in ("hits", "queries"))
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[-1][0] <= now:
            at, prompt, out = pending.pop()
            r = engine.add_request(prompt, SamplingParams(max_tokens=out, temperature=0, ignore_eos=True))
            r.arrival = t0 + at  # the scheduled time: waiting for the step boundary is latency too
            requests.append((r, out))
        if not engine.has_unfinished():
            time.sleep(max(pending[-1][0] - now, 0))
            continue
        engine.step()
        running = [(i, r) for i, rep in enumerate(engine.schedulers) for r in rep.running]
        if running:
            held = sum(r.computed for _, r in running)
            pages = len({(i, p) for i, r in running for p in r.pages.tolist()})
            samples.append((held, pages, len(running)))
    duration = max(t for r, _ in requests for t in r.token_times) - t0
    return {"requests": requests, "duration": duration, "samples": samples, "stats": engine.stats - before,
            "compilations": engine.compilations - compiled,
            "hits": sum(r.pool.hits for r in engine.schedulers) - hits,
            "queries": sum(r.pool.queries for r in engine.schedulers) - queries}


def dist(xs: list[float], ms: float = 1e3) -> dict:
    """mean / median / p99 in milliseconds."""
    a = np.asarray(xs, float) * ms if xs else np.zeros(1)
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99))}


def page_hash_us(page_size: int, tokens: int = 4096, repeats: int = 5) -> float:
    """Microseconds to key one page (see the module docstring)."""
    from jaxinfer.engine.page_pool import page_hashes

    ids = np.random.default_rng(0).integers(0, 32000, tokens).tolist()
    best = min(timeit.repeat(lambda: page_hashes(ids, page_size), number=1, repeat=repeats))
    return 1e6 * best / (tokens // page_size)


def summarise(res: dict, page_size: int, max_len: int, pool_pages: int) -> dict:
    """The figures of the module docstring from one served workload."""
    reqs, d = [r for r, _ in res["requests"]], res["duration"]
    out_tokens, prompt_tokens = sum(len(r.output) for r in reqs), sum(len(r.prompt) for r in reqs)
    held, pages, running = (np.asarray(c, float) for c in zip(*res["samples"], strict=True))
    paged, contiguous = float(np.mean(held / (pages * page_size))), float(np.mean(held / (running * max_len)))
    return {
        "completed": sum(r.finish_reason is not None for r in reqs),
        "exact_output_lengths": all(len(r.output) == n for r, n in res["requests"]),
        "duration_s": d, "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "request_throughput": len(reqs) / d, "output_throughput": out_tokens / d,
        "total_token_throughput": (prompt_tokens + out_tokens) / d,
        "ttft": dist([r.token_times[0] - r.arrival for r in reqs]),
        "tpot": dist([(r.token_times[-1] - r.token_times[0]) / (len(r.output) - 1) for r in reqs
                      if len(r.output) > 1]),
        "itl": dist([b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:], strict=False)]),
        "prefix_cache_hits": res["hits"], "prefix_cache_queries": res["queries"],
        "preemptions": res["stats"].preemptions, "steps": res["stats"].steps,
        "compilations_measured": res["compilations"], "compile_seconds_measured": res["stats"].compile_seconds,
        "kv_utilisation_paged": paged, "kv_utilisation_contiguous": contiguous,
        "paged_over_contiguous": paged / contiguous, "peak_pages_in_use": int(pages.max()), "pool_pages": pool_pages,
        "page_hash_us": page_hash_us(page_size),
    }


def check_args(args: argparse.Namespace) -> int:
    """Refuses impossible workloads; returns the longest request (max prompt + max output length)."""
    (p0, p1), (o0, o1) = args.prompt_len_range, args.output_len_range
    if not (1 <= p0 <= p1 and 1 <= o0 <= o1 and args.num_requests >= 1 and args.request_rate > 0):
        raise ValueError("need 1 <= MIN <= MAX for both length ranges, --num-requests >= 1, --request-rate > 0")
    if (args.concurrency is not None and args.concurrency < 1) or args.vocab_size < 1:
        raise ValueError("--concurrency and --vocab-size must be >= 1")
    return p1 + o1


def warmup_passes(args: argparse.Namespace) -> int:
    """A second pass with compiled buckets times finite-rate arrivals more like the measured one."""
    return 1 if math.isinf(args.request_rate) else 2


def load(args: argparse.Namespace):
    """The LLM of --model (or the random-weight --preset), checked to hold the longest request; and its label."""
    import jax

    from jaxinfer.llm import LLM
    from jaxinfer.random_model import BENCH_100M, DEFAULT, ensure

    max_len = check_args(args)
    name, cfg = {"bench": ("bench-100m-random-llama", BENCH_100M), "small": ("default-random-llama", DEFAULT)}[
        args.preset]
    path = ensure(name, cfg) if args.model is None else args.model
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    llm = LLM(path, mesh=args.mesh, dtype=dtype, engine_config=EngineConfig.from_cli_args(args))
    check_fits(llm, max_len)
    return llm, f"{name} (random weights)" if args.model is None else str(llm.path)


def check_fits(llm, max_len: int) -> None:
    """The longest request (max prompt + max output length) within the context and one replica's page pool."""
    if max_len > min(llm.config.context_length, llm.engine.capacity):
        raise ValueError(f"max prompt + output length {max_len} exceeds the context limit {llm.config.context_length} "
                         f"or the {llm.engine.capacity}-token page pool; shorten the ranges")


def describe(llm, label: str, args: argparse.Namespace) -> dict:
    """The model, the mesh and the workload: the head of every report."""
    import jax.numpy as jnp

    return {
        "model": llm.source, "random_weights": args.model is None, "label": label,
        "num_params": llm.config.num_params(), "dtype": jnp.dtype(llm.dtype).name, "mesh": str(llm.mesh_config),
        "platform": llm.layout.platform, "attention_backend": llm.engine.runner.backend,
        **describe_workload(args),
    }


def describe_workload(args: argparse.Namespace) -> dict:
    return {"num_requests": args.num_requests,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "prompt_len_range": list(args.prompt_len_range), "output_len_range": list(args.output_len_range)}


def run(args: argparse.Namespace) -> dict:
    """Warm-up pass, measured pass, and the report (the --json output)."""
    return measure_serving(*load(args), args)


def measure_serving(llm, label: str, args: argparse.Namespace) -> dict:
    """run() on an LLM already made (e.g. LLM.random, whose engine knobs should be those of `args`): the
    workload and seed of `args`."""
    check_fits(llm, check_args(args))
    engine, max_len = llm.engine, args.prompt_len_range[1] + args.output_len_range[1]
    vocab = llm.config.vocab_size
    t, passes = time.perf_counter(), warmup_passes(args)
    for i in range(passes):
        serve(engine, workload(args, vocab, args.seed + 1 + i))
        engine.reset_prefix_cache()  # an empty prefix cache again: the next pass schedules as this one did
    warmup = time.perf_counter() - t
    result = summarise(serve(engine, workload(args, vocab, args.seed)), args.page_size, max_len,
                       engine.pages_per_replica * len(engine.schedulers))
    return {
        **describe(llm, label, args), "page_size": args.page_size,
        "max_num_seqs": args.max_num_seqs, "max_tokens_per_step": engine.packer.max_tokens, "seed": args.seed,
        "warmup_s": warmup, "warmup_passes": passes, "compilations_total": engine.compilations, **result,
    }


# ---- HTTP load (--http, --url) ---------------------------------------------------------------------------
@dataclasses.dataclass
class Record:
    """One streamed request as its client saw it: when it was sent, and each token's time and text."""

    sent: float
    times: list[float] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)


# (prompt ids, max_tokens) -> the text of each token as it comes
TokenStream = Callable[[list[int], int], AsyncIterator[str]]
# a workload -> its records and its start time (perf_counter)
Pass = Callable[[Work], Awaitable[tuple[list[Record], float]]]


async def drive(stream: TokenStream, work: Work, concurrency: int) -> tuple[list[Record], float]:
    """Each request sent at its arrival time, by one of `concurrency` clients; records in workload order."""
    clients, t0 = asyncio.Semaphore(concurrency), time.perf_counter()

    async def client(at: float, prompt: list[int], max_tokens: int) -> Record:
        await asyncio.sleep(max(t0 + at - time.perf_counter(), 0))
        async with clients:
            record = Record(time.perf_counter())
            async for text in stream(prompt, max_tokens):
                record.times.append(time.perf_counter())
                record.texts.append(text)
            return record

    return list(await asyncio.gather(*(client(*w) for w in work))), t0


async def in_process_pass(llm, concurrency: int, work: Work) -> tuple[list[Record], float]:
    """The workload through llm.loop's streams."""
    from jaxinfer.sampling import SamplingParams

    async def stream(prompt: list[int], max_tokens: int) -> AsyncIterator[str]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for _, delta in llm.loop.submit(prompt, params, asynchronous=True):
            yield delta

    return await drive(stream, work, concurrency)


async def http_pass(url: str, model: str, api_key: str | None, concurrency: int,
                    work: Work) -> tuple[list[Record], float]:
    """The workload as streamed POST /v1/completions, over one client's connections."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits, headers=auth(api_key)) as client:

        async def stream(prompt: list[int], max_tokens: int) -> AsyncIterator[str]:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    error = (await response.aread()).decode(errors="replace")
                    raise OSError(f"POST {url}/v1/completions: {response.status_code} {error}")
                async for line in response.aiter_lines():
                    for text in sse_tokens(line):
                        yield text

        return await drive(stream, work, concurrency)


def sse_tokens(line: str) -> list[str]:
    """The tokens' texts in one server-sent event line of a streamed completion: each choice without a
    finish_reason carries one token (its text may be empty); a choice's last chunk has only the finish_reason."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return []
    chunk = json.loads(line[len("data: "):])
    if "error" in chunk:
        raise OSError(f"the server failed a request: {chunk['error'].get('message')}")
    return [c["text"] for c in chunk["choices"] if c["finish_reason"] is None]


def auth(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def stream_figures(records: list[Record], t0: float, work: Work) -> dict:
    """The HTTP-load figures of the module docstring from one pass."""
    tokens = sum(len(r.times) for r in records)
    duration = max(r.times[-1] for r in records if r.times) - t0
    return {"duration_s": duration, "output_tokens": tokens,
            "exact_output_lengths": all(len(r.times) == n for r, (_, _, n) in zip(records, work, strict=True)),
            "request_throughput": len(records) / duration, "output_throughput": tokens / duration,
            "ttft": dist([r.times[0] - r.sent for r in records if r.times]),
            "itl": dist([b - a for r in records for a, b in zip(r.times, r.times[1:], strict=False)])}


def reset(llm) -> None:
    """Empties the prefix cache of `llm` (None: a remote server, whose cache this cannot reach)."""
    if llm is not None:
        with llm.loop.lock:
            llm.engine.reset_prefix_cache()


def warm_up(run_pass: Pass, args: argparse.Namespace, vocab: int, llm=None) -> float:
    """The warm-up pass(es): the measured workload's shape with other tokens. Returns the seconds taken."""
    t = time.perf_counter()
    for i in range(warmup_passes(args)):
        asyncio.run(run_pass(workload(args, vocab, args.seed + 1 + i)))
        reset(llm)
    return time.perf_counter() - t


def measure(run_pass: Pass, args: argparse.Namespace, vocab: int, llm=None) -> tuple[list[Record], dict]:
    """The measured pass: its records and figures; with `llm` (served here), the compilations it waited for."""
    compiled = (llm.engine.compilations, llm.engine.stats.compile_seconds) if llm is not None else None
    work = workload(args, vocab, args.seed)
    records, t0 = asyncio.run(run_pass(work))
    figures = stream_figures(records, t0, work)
    if compiled is not None:
        figures["compilations_measured"] = llm.engine.compilations - compiled[0]
        figures["compile_seconds_measured"] = llm.engine.stats.compile_seconds - compiled[1]
    reset(llm)
    return records, figures


def _http_pass_here(*args) -> tuple[list[Record], float]:
    return asyncio.run(http_pass(*args))


async def http_pass_elsewhere(clients: ProcessPoolExecutor, *args) -> tuple[list[Record], float]:
    """http_pass in the `clients` process, so the clients' own JSON parsing does not take the server's GIL
    (perf_counter is the system's monotonic clock: its times compare across processes)."""
    return await asyncio.get_running_loop().run_in_executor(clients, _http_pass_here, *args)


def run_http(args: argparse.Namespace) -> dict:
    """--http: the workload in-process, then over HTTP to a server in this process (the HTTP clients in
    another process, as real clients are); both ways' figures."""
    llm, label = load(args)
    concurrency, vocab, model = args.concurrency or args.num_requests, llm.config.vocab_size, llm.path.name
    spawn = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
    from jaxinfer.serve.server import http_server

    with http_server(llm, model) as url, ProcessPoolExecutor(1, mp_context=spawn) as clients:
        ways = [functools.partial(in_process_pass, llm, concurrency),
                functools.partial(http_pass_elsewhere, clients, url, model, None, concurrency)]
        warmup = [warm_up(w, args, vocab, llm) for w in ways]  # both ways warm before either is measured
        (local, a), (remote, h) = (measure(w, args, vocab, llm) for w in ways)
    return {**describe(llm, label, args), "concurrency": concurrency, "seed": args.seed,
            "warmup_passes": warmup_passes(args), "in_process": a | {"warmup_s": warmup[0]},
            "http": h | {"warmup_s": warmup[1]},
            "http_over_in_process": {"throughput_ratio": h["output_throughput"] / a["output_throughput"],
                                     "ttft_median_diff_ms": h["ttft"]["median_ms"] - a["ttft"]["median_ms"],
                                     "itl_median_diff_ms": h["itl"]["median_ms"] - a["itl"]["median_ms"]},
            "outputs_match": all(x.texts == y.texts for x, y in zip(local, remote, strict=True))}


def served_model(url: str, api_key: str | None) -> tuple[str, int | None]:
    """The first model of GET /v1/models and its max_model_len (if the server tells it)."""
    import httpx

    try:
        response = httpx.get(f"{url}/v1/models", headers=auth(api_key), timeout=30)
        response.raise_for_status()
    except httpx.HTTPError as e:
        raise OSError(f"GET {url}/v1/models failed: {e}") from None
    model = response.json()["data"][0]
    return model["id"], model.get("max_model_len")


def run_url(args: argparse.Namespace) -> dict:
    """--url: the workload over HTTP to a running server."""
    max_len, url = check_args(args), args.url.rstrip("/")
    model, limit = served_model(url, args.api_key)
    if limit is not None and max_len > limit:
        raise ValueError(f"max prompt + output length {max_len} exceeds the server's max_model_len {limit}")
    concurrency = args.concurrency or args.num_requests
    run_pass = functools.partial(http_pass, url, model, args.api_key, concurrency)
    warmup = warm_up(run_pass, args, args.vocab_size)
    _, h = measure(run_pass, args, args.vocab_size)
    return {"url": url, "label": model, **describe_workload(args), "vocab_size": args.vocab_size,
            "concurrency": concurrency, "seed": args.seed, "warmup_passes": warmup_passes(args),
            "http": h | {"warmup_s": warmup}}


def readable(r: dict) -> str:
    """vLLM-style result block."""
    rows = [("Model", f"{r['label']} [{r['num_params'] / 1e6:.1f}M, {r['dtype']}]"),
            ("Mesh / platform", f"{r['mesh']} / {r['platform']} ({r['attention_backend']} attention)"),
            ("Requests (rate/s)", f"{r['completed']}/{r['num_requests']} ({r['request_rate']})"),
            ("Prompt / output len ranges", f"{r['prompt_len_range']} / {r['output_len_range']}"),
            ("Benchmark duration (s)", f"{r['duration_s']:.2f}  (warm-up {r['warmup_s']:.1f} s)"),
            ("Prompt / output tokens", f"{r['prompt_tokens']} / {r['output_tokens']}"),
            ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{r['output_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{r['total_token_throughput']:.1f}")]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
        x = r[key]
        rows.append((f"{label} mean/median/p99 (ms)", f"{x['mean_ms']:.1f} / {x['median_ms']:.1f} / {x['p99_ms']:.1f}"))
    rows += [("Prefix cache hits / queries (pages)", f"{r['prefix_cache_hits']} / {r['prefix_cache_queries']}"),
             ("Preemptions / steps", f"{r['preemptions']} / {r['steps']}"),
             ("Compilations measured (total)", f"{r['compilations_measured']} ({r['compilations_total']}), "
              f"{r['compile_seconds_measured']:.1f} s"),
             ("KV util paged / contiguous", f"{r['kv_utilisation_paged']:.1%} / {r['kv_utilisation_contiguous']:.1%}"
              f"  (x{r['paged_over_contiguous']:.2f} requests in the same memory)"),
             ("Peak pages in use / pool", f"{r['peak_pages_in_use']} / {r['pool_pages']}"),
             ("Prefix-cache key (SHA-256) per page", f"{r['page_hash_us']:.2f} us")]
    bar = "=" * 30 + " Serving Benchmark Result " + "=" * 30
    return "\n".join([bar, *(f"{k:<38}{v}" for k, v in rows), "=" * len(bar)])


def readable_http(r: dict) -> str:
    """--http / --url: the ways side by side, and HTTP against in-process where both ran."""
    ways = [(w, name) for w, name in (("in_process", "in-process"), ("http", "HTTP")) if w in r]
    vs = r.get("http_over_in_process")

    def row(label: str, cell: Callable[[dict], str], versus: str = "") -> str:
        cells = "".join(f"{cell(r[w]):>22}" for w, _ in ways)
        return f"{label:<34}{cells}{versus:>20}".rstrip()

    def latency(key: str) -> Callable[[dict], str]:
        return lambda x: f"{x[key]['median_ms']:.2f} / {x[key]['p99_ms']:.2f}"

    if "url" in r:
        head = [("Server / model", f"{r['url']} / {r['label']}")]
    else:
        head = [("Model", f"{r['label']} [{r['num_params'] / 1e6:.1f}M, {r['dtype']}]"),
                ("Mesh / platform", f"{r['mesh']} / {r['platform']} ({r['attention_backend']} attention)")]
    head += [("Requests (rate/s) / clients", f"{r['num_requests']} ({r['request_rate']}) / {r['concurrency']}"),
             ("Prompt / output len ranges", f"{r['prompt_len_range']} / {r['output_len_range']}")]
    lines = [f"{k:<34}{v}" for k, v in head]
    lines.append(f"{'':<34}" + "".join(f"{name:>22}" for _, name in ways) + (f"{'HTTP/in-process':>20}" if vs else ""))
    lines += [row("Duration (s)", lambda x: f"{x['duration_s']:.2f}"),
              row("Output tokens", lambda x: str(x["output_tokens"])),
              row("Request throughput (req/s)", lambda x: f"{x['request_throughput']:.2f}"),
              row("Output token throughput (tok/s)", lambda x: f"{x['output_throughput']:.1f}",
                  f"x{vs['throughput_ratio']:.3f}" if vs else ""),
              row("TTFT median / p99 (ms)", latency("ttft"), f"{vs['ttft_median_diff_ms']:+.2f} ms" if vs else ""),
              row("ITL median / p99 (ms)", latency("itl"), f"{vs['itl_median_diff_ms']:+.2f} ms" if vs else ""),
              row("Warm-up (s)", lambda x: f"{x['warmup_s']:.1f}")]
    if vs:
        lines += [row("Compilations measured (stall)",
                      lambda x: f"{x['compilations_measured']} ({x['compile_seconds_measured']:.1f} s)"),
                  f"{'Outputs match':<34}{'yes' if r['outputs_match'] else 'NO'}"]
    width = max(map(len, lines))
    return "\n".join([" Serving Benchmark: HTTP load ".center(width, "="), *lines, "=" * width])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.http or args.url:
        return bench_command(args, run_http if args.http else run_url, readable_http)
    return bench_command(args, run, readable)


if __name__ == "__main__":
    sys.exit(main())
