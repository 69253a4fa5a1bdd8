"""`python -m jaxinfer.bench.attention`: the CPU attention kernel against the jnp reference, call by call.

    python -m jaxinfer.bench.attention                      # decode and prompt shapes of the bench models
    python -m jaxinfer.bench.attention --case "decode 8 x 1k" --rounds 20 --json

Each case is one step's attention over a paged cache (one layer, random float32 K/V, pages of 16): its
sequences' query tokens and context lengths, and the model's heads (BENCH_100M's 12 query and 4 KV heads
of 64, BENCH_LONG's 8 and 4 of 32). Both sides are compiled first, then timed in alternating rounds of
five calls in a row (so both see the same machine, each with its own data in cache), and the best round
is reported per call; "error" is the largest difference between their outputs. The kernel alone, without
the step around it: where an engine's step spends its time is `python -m jaxinfer.bench --profile`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.device.attention import cpu
from jaxinfer.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

PAGE = 16
CASES = {  # name: (query heads, kv heads, head_dim, [(query tokens, context after the step) per sequence])
    "decode 8 x 64": (12, 4, 64, [(1, 64)] * 8),
    "decode 8 x 1k": (12, 4, 64, [(1, 1024)] * 8),
    "prompt 256": (12, 4, 64, [(256, 256)]),
    "chunk 256 after 2k": (12, 4, 64, [(256, 2048)]),
    "chunk 256 after 8k (long)": (8, 4, 32, [(256, 8192)]),
    "4 chunks of 32 + 4 decodes": (12, 4, 64, [(32, 300)] * 4 + [(1, 500)] * 4),
}
CALLS = 5


def inputs(heads: int, kv_heads: int, head_dim: int, seqs: list[tuple[int, int]], seed: int = 0) -> tuple:
    """The operands of ragged paged attention for one step of `seqs`, each sequence on pages of its own."""
    rng = np.random.default_rng(seed)
    pages = [-(-context // PAGE) for _, context in seqs]
    pool = (1, kv_heads, sum(pages) + 1, PAGE, head_dim)
    table = np.zeros((len(seqs), max(pages)), np.int32)
    for s, first in enumerate(np.cumsum([0, *pages[:-1]])):
        table[s, : pages[s]] = np.arange(first, first + pages[s])
    starts = np.cumsum([0] + [tokens for tokens, _ in seqs])
    return (jnp.asarray(rng.standard_normal((starts[-1], heads, head_dim)), jnp.float32),
            jnp.asarray(rng.standard_normal(pool), jnp.float32), jnp.asarray(rng.standard_normal(pool), jnp.float32),
            jnp.int32(0), jnp.asarray(table), jnp.asarray([context for _, context in seqs], jnp.int32),
            jnp.asarray(starts, jnp.int32), jnp.int32(len(seqs)))


def measure(name: str, rounds: int) -> dict:
    heads, kv_heads, head_dim, seqs = CASES[name]
    args, scale = inputs(heads, kv_heads, head_dim, seqs), head_dim ** -0.5
    sides = {"kernel": jax.jit(lambda *a: cpu.ragged_paged_attention(*a, sm_scale=scale)),
             "reference": jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=scale))}
    outs = {side: np.asarray(f(*args)) for side, f in sides.items()}
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(rounds):
        for side, f in sides.items():
            jax.block_until_ready(f(*args))
            t0 = time.perf_counter()
            for _ in range(CALLS):
                out = f(*args)
            jax.block_until_ready(out)
            best[side] = min(best[side], (time.perf_counter() - t0) / CALLS)
    return {"case": name, "tokens": sum(t for t, _ in seqs), "sequences": len(seqs), "heads": heads,
            "kv_heads": kv_heads, "head_dim": head_dim, "kernel_ms": best["kernel"] * 1e3,
            "reference_ms": best["reference"] * 1e3, "speedup": best["reference"] / best["kernel"],
            "error": float(np.abs(outs["kernel"] - outs["reference"]).max())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.attention", description=__doc__.split("\n")[0])
    p.add_argument("--case", action="append", choices=list(CASES), help="the cases to time (default: all)")
    p.add_argument("--rounds", type=int, default=10, help="alternating rounds of five calls per side")
    p.add_argument("--json", action="store_true", help="one JSON list on stdout")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if reason := cpu.unavailable_reason():
        print(f"the CPU attention kernel is unavailable here: {reason}", file=sys.stderr)
        return 1
    rows = [measure(name, args.rounds) for name in args.case or CASES]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'case':28s} {'kernel ms':>10} {'reference ms':>13} {'speedup':>8} {'error':>9}")
    for r in rows:
        print(f"{r['case']:28s} {r['kernel_ms']:10.3f} {r['reference_ms']:13.3f} {r['speedup']:7.2f}x "
              f"{r['error']:9.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
