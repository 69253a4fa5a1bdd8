"""`python -m jaxinfer.bench`: prefill and decode tokens/s, decode MBU and collectives on a mesh.

    python -m jaxinfer.bench                          # random-weight ~125M Llama (BENCH_100M), batch 1 and 8
    python -m jaxinfer.bench --mesh tp=2 --json       # one JSON object on stdout
    python -m jaxinfer.bench --model /ckpt/Llama-3.2-1B --batch 1 4 --prompt-len 512 --dtype bfloat16

Why each number is what it is:
- Timings come from Engine.stats (compilation excluded). Each batch size gets one warm-up generate with
  the same shapes, so the measured run hits compiled executables; compile_seconds is reported apart.
- Memory bandwidth is measured in the same run: the best of a few numpy copies of a 256 MiB buffer
  (far beyond any cache), on one thread and on all cores, counting read + write bytes. On CPU all fake
  devices share this one memory system, so the figure is that of the whole host, not of one device.
- Decode MBU = (W + K) x decode_steps / decode_seconds / bandwidth, where
  W = bytes of all parameter shards summed over all devices (a weight replicated on r devices counts r
  times: each copy is read once per step; under tp the norm vectors are replicated, under dp everything);
  K = layers x batch x 2 x kv_heads x head_dim x dtype_bytes x average context during decode, kv_heads
  after replication for tp, average context = prompt_len + (decode_steps + 1) / 2.
  W + K is what a decode step must read, not exactly what this implementation moves: W counts the whole
  embedding table although a step gathers only `batch` rows of it (fewer bytes), while attention and the
  reads every page of the page-table bucket (a power of two), not just the context (more bytes).
- OPENBLAS: this module sets no OPENBLAS_*/OMP_* variables (nor any other thread setting); numpy's copy
  does not use BLAS and changing them would change how numpy and XLA:CPU share the cores. Set them
  outside the process if wanted; the output then reflects that setting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxinfer.mesh import MeshError, mesh_for_cli

GB = 1e9
MBU_FORMULA = ("MBU = (W + K) * decode_steps / decode_seconds / bandwidth; W = parameter-shard bytes summed "
               "over devices; K = layers*batch*2*kv_heads*head_dim*dtype_bytes*(prompt_len + (decode_steps+1)/2)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the random-weight "
                   "~125M Llama BENCH_100M that jaxinfer writes into its cache directory)")
    p.add_argument("--mesh", default="", help='e.g. "tp=2" or "dp=2,tp=4" (default: one device)')
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes to measure")
    p.add_argument("--prompt-len", type=int, default=128, help="synthetic prompt tokens per sequence")
    p.add_argument("--max-tokens", type=int, default=32, help="generated tokens per sequence")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="default float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="buffer size of the bandwidth copy")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return p.parse_args(argv)


def memory_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Host copy bandwidth in GB/s (read + write bytes), best over repeats, one thread or all cores."""
    src = np.ones(mib * 2**20, np.uint8)
    dst = np.zeros_like(src)  # touched now, so page faults stay out of the timing
    best = math.inf
    for threads in sorted({1, os.cpu_count() or 1}):
        pieces = list(zip(np.array_split(dst, threads), np.array_split(src, threads), strict=True))
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(repeats):
                t0 = time.perf_counter()
                list(pool.map(lambda ds: np.copyto(*ds), pieces))
                best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / GB


def weight_bytes_read(llm) -> int:
    """W: bytes of every parameter shard on every device (a replicated weight counts once per copy)."""
    from jaxinfer.sharding import device_bytes

    return sum(device_bytes(llm.engine.params, d) for d in llm.layout.mesh.devices.flat)


def kv_bytes_read(llm, batch: int, avg_context: float) -> float:
    """K: cache bytes a decode step must read, at the average context length of the decode steps."""
    import jax.numpy as jnp

    cfg = llm.config
    itemsize = jnp.dtype(llm.dtype).itemsize
    return cfg.num_layers * batch * 2 * llm.engine.kv_heads * cfg.head_dim * itemsize * avg_context


def bench_batch(llm, batch: int, prompt_len: int, max_tokens: int, seed: int, bandwidth: float) -> dict:
    """One warm-up generate (compiles every step for these shapes), then the measured one."""
    from jaxinfer.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    warmup, prompts = (rng.integers(0, llm.config.vocab_size, (batch, prompt_len)).tolist() for _ in range(2))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(warmup, params)  # other tokens than the measured prompts: no prefix-cache hits
    before = llm.engine.stats.copy()
    compile_seconds = before.compile_seconds
    llm.generate(prompts, params)
    s = llm.engine.stats - before
    avg_context = prompt_len + (s.decode_steps + 1) / 2
    w, k = weight_bytes_read(llm), kv_bytes_read(llm, batch, avg_context)
    steps_per_s = s.decode_steps / s.decode_seconds if s.decode_seconds else 0.0
    report = llm.collective_report()
    return {
        "batch": batch, "prefill_tokens": s.prefill_tokens, "prefill_seconds": s.prefill_seconds,
        "prefill_tokens_per_second": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else 0.0,
        "decode_tokens": s.decode_tokens, "decode_steps": s.decode_steps, "decode_seconds": s.decode_seconds,
        "decode_tokens_per_second": s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0,
        "decode_ms_per_token": 1e3 * s.decode_seconds / s.decode_steps if s.decode_steps else 0.0,
        "compile_seconds": compile_seconds + s.compile_seconds,   # the second term is 0 unless shapes changed
        "avg_decode_context": avg_context,
        "weight_bytes_per_step": w, "kv_bytes_per_step": k,
        "decode_bandwidth_gbps": (w + k) * steps_per_s / GB,
        "mbu": (w + k) * steps_per_s / GB / bandwidth,
        "collectives": report,
    }


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark as one dict (the --json output)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.llm import LLM
    from jaxinfer.random_model import BENCH_100M, ensure

    random_weights = args.model is None
    path = ensure("bench-100m-random-llama", BENCH_100M) if random_weights else args.model
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    llm = LLM(path, mesh=args.mesh, dtype=dtype)
    bandwidth = memory_bandwidth(args.bandwidth_mib)
    results = [bench_batch(llm, b, args.prompt_len, args.max_tokens, args.seed, bandwidth) for b in args.batch]
    return {
        "model": str(llm.path), "label": "BENCH_100M (random weights)" if random_weights else str(llm.path),
        "random_weights": random_weights, "architecture": llm.config.architecture,
        "num_params": llm.config.num_params(), "dtype": jnp.dtype(llm.dtype).name,
        "mesh": {a: getattr(llm.mesh_config, a) for a in ("dp", "pp", "tp", "ep", "sp")},
        "devices": llm.mesh_config.size, "platform": llm.layout.mesh.devices.flat[0].platform,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "memory_bandwidth_gbps": bandwidth, "bandwidth_note": "host numpy copy, read+write bytes, best of runs; "
        "on CPU all fake devices share this memory", "mbu_formula": MBU_FORMULA,
        "weight_bytes_per_step": weight_bytes_read(llm), "results": results,
    }


def readable(r: dict) -> str:
    """The human-readable table."""
    mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "single device"
    lines = [f"model     {r['label']} [{r['architecture']}, {r['num_params'] / 1e6:.1f}M params, {r['dtype']}]",
             f"mesh      {mesh} on {r['devices']} {r['platform']} device(s); prompt {r['prompt_len']} tokens, "
             f"{r['max_tokens']} generated",
             f"memory    {r['memory_bandwidth_gbps']:.1f} GB/s host copy bandwidth (read+write; shared by all "
             f"CPU devices); W = {r['weight_bytes_per_step'] / 2**20:.1f} MiB of weight shards read per step",
             f"{'batch':>5} {'prefill tok/s':>13} {'decode tok/s':>12} {'ms/token':>9} {'decode GB/s':>11} "
             f"{'MBU':>6} {'compile s':>9}"]
    for x in r["results"]:
        lines.append(f"{x['batch']:>5} {x['prefill_tokens_per_second']:>13.1f} {x['decode_tokens_per_second']:>12.1f}"
                     f" {x['decode_ms_per_token']:>9.2f} {x['decode_bandwidth_gbps']:>11.2f} {x['mbu']:>6.1%}"
                     f" {x['compile_seconds']:>9.1f}")
    for x in r["results"]:
        ar = x["collectives"].get("decode", {}).get("all-reduce", {"count": 0, "bytes": 0})
        lines.append(f"batch {x['batch']}: decode step all-reduce {ar['count']} x, {ar['bytes']:,} bytes per device")
    lines.append(r["mbu_formula"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        mesh_for_cli(args.mesh)
    except MeshError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else readable(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
