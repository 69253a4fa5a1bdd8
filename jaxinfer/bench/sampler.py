"""`python -m jaxinfer.bench.sampler`: what the on-device sampler costs per step, by rows and vocabulary.

    python -m jaxinfer.bench.sampler                      # batch 1, 8, 32 at vocabularies of 32k and 128k
    python -m jaxinfer.bench.sampler --batch 32 --vocab 151936 --json

For random float32 logits it times (best of a few calls, compiled beforehand): greedy rows; temperature
alone (no filter: a division); temperature with top-k 50 and top-p 0.9 (the filters' thresholds by
bisection, then the draw), in one pass over the rows and row by row (the CPU's way); one such row among
greedy padding rows (a lone prompt in a prompt step's slots), both ways; the filters alone; and, for
scale, a full descending sort of the same rows, which is what a sort-based top-p/top-k costs before
anything else.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.sampling import SamplingArrays, SamplingParams, filter_logits, sample

CASES = {"greedy": SamplingParams(temperature=0), "temperature": SamplingParams(temperature=0.8),
         "top_k_top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9)}


def best_ms(fn, *args, calls: int = 3) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def measure(batch: int, vocab: int) -> dict:
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(batch, vocab)) * 3, jnp.float32)
    positions = jnp.arange(batch, dtype=jnp.int32)
    out = {"batch": batch, "vocab": vocab}
    one_pass, by_row = jax.jit(sample), jax.jit(functools.partial(sample, row_by_row=True))
    for name, params in CASES.items():
        arrays = SamplingArrays.from_params([params] * batch, batch, list(range(batch)))
        out[f"{name}_ms"] = best_ms(one_pass, logits, arrays, positions)
    filtering = SamplingArrays.from_params([CASES["top_k_top_p"]] * batch, batch, list(range(batch)))
    out["top_k_top_p_by_row_ms"] = best_ms(by_row, logits, filtering, positions)
    lone = SamplingArrays.from_params([CASES["top_k_top_p"]], batch, [0])   # the other rows: greedy padding
    out["one_drawing_ms"] = best_ms(one_pass, logits, lone, positions)
    out["one_drawing_by_row_ms"] = best_ms(by_row, logits, lone, positions)
    out["filters_ms"] = best_ms(jax.jit(filter_logits), logits, filtering)
    out["full_sort_ms"] = best_ms(jax.jit(lambda x: -jnp.sort(-x, axis=-1)), logits)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.sampler", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, action="append", help="rows per call (default 1, 8 and 32)")
    p.add_argument("--vocab", type=int, action="append", help="vocabulary size (default 32000 and 128256)")
    p.add_argument("--json", action="store_true", help="one JSON list on stdout")
    args = p.parse_args(argv)
    for name in ("batch", "vocab"):
        if any(v < 1 for v in getattr(args, name) or []):
            p.error(f"--{name} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [measure(b, v) for v in args.vocab or [32000, 128256] for b in args.batch or [1, 8, 32]]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'batch':>5} {'vocab':>7} {'greedy':>8} {'temp':>8} {'top-k/p':>9} {'by row':>8} {'1 drawing':>10} "
          f"{'by row':>8} {'filters':>9} {'full sort':>10}  (ms)")
    for r in rows:
        print(f"{r['batch']:5d} {r['vocab']:7d} {r['greedy_ms']:8.2f} {r['temperature_ms']:8.2f} "
              f"{r['top_k_top_p_ms']:9.2f} {r['top_k_top_p_by_row_ms']:8.2f} {r['one_drawing_ms']:10.2f} "
              f"{r['one_drawing_by_row_ms']:8.2f} {r['filters_ms']:9.2f} {r['full_sort_ms']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
