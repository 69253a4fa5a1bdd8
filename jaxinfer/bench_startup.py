"""`python -m jaxinfer.bench_startup`: how long a fresh process takes to serve, cold and warm.

    python -m jaxinfer.bench_startup                          # the serving benchmark's model and the default
    python -m jaxinfer.bench_startup --preset small --json

Each figure is one fresh Python process (same flags as `python -m jaxinfer.serve` would load), timed from its
launch: first_token_s = the model loaded and one token generated; ready_s = then every warm-up bucket compiled
(jaxinfer.warmup), i.e. when the server would start listening. cold: an empty compilation cache (a temporary
directory); warm: the same directory again, a restart on the same machine. The random-weight checkpoints
come from the usual cache directory (written beforehand), so neither run pays for writing them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from jaxinfer.bench import PRESETS as BENCH_PRESETS

PRESETS = {"bench": BENCH_PRESETS["dense"], "small": ("default-random-llama", "DEFAULT")}

CHILD = """
import json, sys, time
from jaxinfer import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32")
llm.generate([[1, 72, 101, 108]], SamplingParams(max_tokens=1, temperature=0))
first = time.time()
compiled = llm.warmup(progress=False)
print(json.dumps({"first": first, "ready": time.time(), "compiled": compiled,
                  "compilations": llm.engine.compilations, "compile_s": llm.engine.runner.compile_seconds}))
llm.close()
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench_startup", description=__doc__.split("\n")[0])
    p.add_argument("--preset", action="append", choices=list(PRESETS),
                   help="model(s) to time (default: bench and small)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return p.parse_args(argv)


def checkpoint(preset: str) -> str:
    from jaxinfer import random_model

    name, config = PRESETS[preset]
    return str(random_model.ensure(name, getattr(random_model, config)))


def start(path: str, xla_cache: str) -> dict:
    """One fresh process: seconds from its launch to its first token and to all buckets ready."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": xla_cache}
    env.pop("JAX_ENABLE_COMPILATION_CACHE", None)
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, path], env=env, check=True,
                         capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return {"first_token_s": r["first"] - t0, "ready_s": r["ready"] - t0, "buckets": r["compilations"],
            "warmup_compiled": r["compiled"], "compile_s": r["compile_s"]}


def run(args: argparse.Namespace) -> dict:
    results = {}
    for preset in args.preset or list(PRESETS):
        path = checkpoint(preset)
        with tempfile.TemporaryDirectory(prefix="jaxinfer-xla-") as xla_cache:
            results[preset] = {"cold": start(path, xla_cache), "warm": start(path, xla_cache)}
    return results


def readable(results: dict) -> str:
    lines = [f"{'model':8} {'start':5} {'first token':>12} {'ready':>9} {'buckets':>8} {'compile':>9}"]
    for preset, runs in results.items():
        for kind, r in runs.items():
            lines.append(f"{preset:8} {kind:5} {r['first_token_s']:11.1f}s {r['ready_s']:8.1f}s {r['buckets']:8d} "
                         f"{r['compile_s']:8.1f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print(json.dumps(results) if args.json else readable(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
