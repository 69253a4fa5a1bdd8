"""`python -m jaxinfer.bench_serving`: serving throughput, latency and KV-cache utilisation (vLLM's figures).

    python -m jaxinfer.bench_serving                        # random-weight BENCH_100M, 32 requests, all at t=0
    python -m jaxinfer.bench_serving --preset small --request-rate 4 --json
    python -m jaxinfer.bench_serving --mesh dp=2 --num-pages 64 --max-tokens-per-step 128

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
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import timeit

import numpy as np

from jaxinfer.bench import cli
from jaxinfer.config import EngineConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench_serving", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the random-weight --preset)")
    p.add_argument("--preset", default="bench", choices=["bench", "small"],
                   help="random-weight model when --model is absent: bench = BENCH_100M (~125M), small = DEFAULT")
    p.add_argument("--mesh", default="", help='e.g. "tp=2" or "dp=2" (default: one device)')
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="default float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second of wall time (default inf: all arrive at t=0)")
    p.add_argument("--prompt-len-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len-range", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    EngineConfig.add_cli_args(p)
    return p.parse_args(argv)


def workload(args: argparse.Namespace, vocab: int, seed: int) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt ids, output length) per request: lengths and arrivals from --seed, tokens
    from `seed`, so the warm-up has the measured pass's shape with other tokens."""
    rng, tok = np.random.default_rng(args.seed), np.random.default_rng(seed)
    n, (p0, p1), (o0, o1) = args.num_requests, args.prompt_len_range, args.output_len_range
    prompt_lens, output_lens = rng.integers(p0, p1 + 1, n), rng.integers(o0, o1 + 1, n)
    gaps = rng.exponential(1 / args.request_rate, n) if math.isfinite(args.request_rate) else np.zeros(n)
    gaps[0] = 0.0
    return [(float(t), tok.integers(0, vocab, int(lp)).tolist(), int(lo))
            for t, lp, lo in zip(np.cumsum(gaps), prompt_lens, output_lens, strict=True)]


def serve(engine, work: list[tuple[float, list[int], int]]) -> dict:
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
            pages = len({(i, p) for i, r in running for p in r.pages})
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
    from jaxinfer.page_pool import page_hashes

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


def run(args: argparse.Namespace) -> dict:
    """Warm-up pass, measured pass, and the report (the --json output)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.llm import LLM
    from jaxinfer.random_model import BENCH_100M, DEFAULT, ensure

    (p0, p1), (o0, o1) = args.prompt_len_range, args.output_len_range
    if not (1 <= p0 <= p1 and 1 <= o0 <= o1 and args.num_requests >= 1 and args.request_rate > 0):
        raise ValueError("need 1 <= MIN <= MAX for both length ranges, --num-requests >= 1, --request-rate > 0")
    name, cfg = {"bench": ("bench-100m-random-llama", BENCH_100M), "small": ("default-random-llama", DEFAULT)}[
        args.preset]
    path = ensure(name, cfg) if args.model is None else args.model
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    llm = LLM(path, mesh=args.mesh, dtype=dtype, engine_config=EngineConfig.from_cli_args(args))
    engine, max_len = llm.engine, p1 + o1
    capacity = engine.pages_per_replica * args.page_size
    if max_len > min(llm.config.context_length, capacity):
        raise ValueError(f"max prompt + output length {max_len} exceeds the context limit "
                         f"{llm.config.context_length} or the {capacity}-token page pool; shorten the ranges")
    vocab = llm.config.vocab_size
    t, passes = time.perf_counter(), 1 if math.isinf(args.request_rate) else 2
    for i in range(passes):  # a second pass with compiled buckets times arrivals more like the measured one
        serve(engine, workload(args, vocab, args.seed + 1 + i))
        engine.reset_prefix_cache()  # an empty prefix cache again: the next pass schedules as this one did
    warmup = time.perf_counter() - t
    result = summarise(serve(engine, workload(args, vocab, args.seed)), args.page_size, max_len,
                       engine.pages_per_replica * len(engine.schedulers))
    return {
        "model": str(llm.path), "random_weights": args.model is None,
        "label": f"{name} (random weights)" if args.model is None else str(llm.path),
        "num_params": llm.config.num_params(), "dtype": jnp.dtype(llm.dtype).name, "mesh": str(llm.mesh_config),
        "platform": llm.layout.mesh.devices.flat[0].platform, "attention_backend": engine.runner.backend,
        "num_requests": args.num_requests,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "prompt_len_range": [p0, p1], "output_len_range": [o0, o1], "page_size": args.page_size,
        "max_num_seqs": args.max_num_seqs, "max_tokens_per_step": engine.max_tokens, "seed": args.seed,
        "warmup_s": warmup, "warmup_passes": passes, "compilations_total": engine.compilations, **result,
    }


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


def main(argv: list[str] | None = None) -> int:
    return cli(parse_args(argv), run, readable)


if __name__ == "__main__":
    sys.exit(main())
