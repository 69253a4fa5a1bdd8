"""`python -m jaxinfer.bench.startup`: how long a fresh process takes to serve, cold and warm.

    python -m jaxinfer.bench.startup                          # the serving benchmark's model and the default
    python -m jaxinfer.bench.startup --preset small --json

Each figure is a fresh Python process, timed from its launch. ready_s: as `python -m jaxinfer.serve` starts,
the model loaded and every warm-up bucket compiled (jaxinfer.engine.warmup), i.e. when the server would start
listening; first_token_s: then one request's first token (it compiles nothing: compiled_by_first_token).
no_warmup_first_token_s: another process, the model loaded and one token generated at once, as with
`--no-warmup` or in a notebook (it compiles the one bucket that token needs). cold: an empty compilation
cache (a temporary directory per process); warm: the same directory again, a restart on the same machine.
The random-weight checkpoints come from the usual cache directory (written beforehand), so no run pays for
writing them.

--load: where the weights come from. Process start to weights loaded and to the first token, from the
Hugging Face safetensors and from the same model converted (python -m jaxinfer.convert, orbax), with a
page cache cold (every file of the directory evicted with posix_fadvise(DONTNEED) first) and warm (read
just before); the compilation cache is warm for all of them (a first, untimed process fills it), so what
differs is the weights' path alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from jaxinfer.bench.decode import PRESETS as BENCH_PRESETS

PRESETS = {"bench": BENCH_PRESETS["dense"], "small": ("default-random-llama", "DEFAULT"),
           "1b": ("bench-1b-random-llama", "BENCH_1B")}
DEFAULTS = {"compile": ["bench", "small"], "load": ["bench", "1b"]}

CHILD = """
import json, sys, time
from jaxinfer import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[3])
loaded = time.time()
compiled = llm.warmup(progress=False) if sys.argv[2] == "serve" else 0
ready = time.time()
before = llm.engine.compilations
llm.generate([[1, 72, 101, 108]], SamplingParams(max_tokens=1, temperature=0))
print(json.dumps({"loaded": loaded, "ready": ready, "first": time.time(), "compiled": compiled,
                  "compiled_by_first": llm.engine.compilations - before, "compilations": llm.engine.compilations,
                  "compile_s": llm.engine.runner.compile_seconds}))
llm.close()
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.startup", description=__doc__.split("\n")[0])
    p.add_argument("--preset", action="append", choices=list(PRESETS),
                   help="model(s) to time (default: bench and small; with --load, bench and 1b)")
    p.add_argument("--load", action="store_true", help="safetensors against a converted checkpoint, cold and warm "
                   "page cache (see above)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return p.parse_args(argv)


def checkpoint(preset: str) -> str:
    from jaxinfer import random_model

    name, config = PRESETS[preset]
    return str(random_model.ensure(name, getattr(random_model, config)))


def converted(preset: str) -> str:
    """The preset's checkpoint converted (jaxinfer.converted), beside it in the cache, made on first use."""
    from jaxinfer.converted import MANIFEST

    src = checkpoint(preset)
    out = f"{src}-converted"
    if not os.path.isfile(os.path.join(out, MANIFEST)):
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "jaxinfer.convert", "--model", src, "--out", out], check=True)
    return out


def evict(path: str) -> None:
    """Every file under `path` out of the page cache (clean pages; no privileges needed)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_through(path: str) -> None:
    """Every file under `path` read once: the page cache warm."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(1 << 24):
                    pass


def start(path: str, xla_cache: str, mode: str, dtype: str = "float32") -> dict:
    """One fresh process (mode "serve": warm-up first; "first": a token at once): seconds from its launch."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": xla_cache}
    env.pop("JAX_ENABLE_COMPILATION_CACHE", None)
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, path, mode, dtype], env=env, check=True,
                         capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return {"loaded_s": r["loaded"] - t0, "ready_s": r["ready"] - t0, "first_token_s": r["first"] - t0,
            "buckets": r["compilations"], "warmup_compiled": r["compiled"],
            "compiled_by_first_token": r["compiled_by_first"], "compile_s": r["compile_s"]}


def start_pair(path: str, serve_cache: str, first_cache: str) -> dict:
    """A server's start and a first token without warm-up, each in its own process and cache directory."""
    served, first = start(path, serve_cache, "serve"), start(path, first_cache, "first")
    return {**served, "no_warmup_first_token_s": first["first_token_s"],
            "no_warmup_compiled": first["compiled_by_first_token"]}


def run_load(presets: list[str]) -> dict:
    """{preset: {source: {cold|warm: start}}} with the compilation cache warm (see --load)."""
    results = {}
    for preset in presets:
        sources = {"safetensors": checkpoint(preset), "converted": converted(preset)}
        with tempfile.TemporaryDirectory(prefix="jaxinfer-xla-") as xla_cache:
            start(sources["safetensors"], xla_cache, "first", "auto")   # fills the compilation cache
            results[preset] = {}
            for source, path in sources.items():
                evict(path)
                cold = start(path, xla_cache, "first", "auto")
                read_through(path)
                results[preset][source] = {"cold": cold, "warm": start(path, xla_cache, "first", "auto"),
                                           "bytes": sum(os.path.getsize(os.path.join(r, f))
                                                        for r, _, fs in os.walk(path) for f in fs)}
    return results


def readable_load(results: dict) -> str:
    lines = [f"{'model':6} {'weights':12} {'on disk':>8} {'page cache':>10} {'loaded':>8} {'first token':>12}"]
    for preset, sources in results.items():
        for source, r in sources.items():
            for kind in ("cold", "warm"):
                lines.append(f"{preset:6} {source:12} {r['bytes'] / 2**30:7.2f}G {kind:>10} "
                             f"{r[kind]['loaded_s']:7.1f}s {r[kind]['first_token_s']:11.1f}s")
        s, c = sources["safetensors"], sources["converted"]
        lines.append(f"{preset:6} converted / safetensors first token: cold "
                     f"{s['cold']['first_token_s'] / c['cold']['first_token_s']:.2f}x faster, warm "
                     f"{s['warm']['first_token_s'] / c['warm']['first_token_s']:.2f}x faster")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    results = {}
    for preset in args.preset or DEFAULTS["compile"]:
        path = checkpoint(preset)
        with (tempfile.TemporaryDirectory(prefix="jaxinfer-xla-") as serve_cache,
              tempfile.TemporaryDirectory(prefix="jaxinfer-xla-") as first_cache):
            results[preset] = {"cold": start_pair(path, serve_cache, first_cache),
                               "warm": start_pair(path, serve_cache, first_cache)}
    return results


def readable(results: dict) -> str:
    lines = [f"{'model':8} {'start':5} {'loaded':>8} {'ready':>8} {'first token':>12} {'buckets':>8} {'compile':>9}"
             f" {'first token without warm-up':>28}"]
    for preset, runs in results.items():
        for kind, r in runs.items():
            lines.append(f"{preset:8} {kind:5} {r['loaded_s']:7.1f}s {r['ready_s']:7.1f}s {r['first_token_s']:11.1f}s "
                         f"{r['buckets']:8d} {r['compile_s']:8.1f}s {r['no_warmup_first_token_s']:27.1f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.load:
        results = run_load(args.preset or DEFAULTS["load"])
        print(json.dumps(results) if args.json else readable_load(results))
        return 0
    results = run(args)
    print(json.dumps(results) if args.json else readable(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
