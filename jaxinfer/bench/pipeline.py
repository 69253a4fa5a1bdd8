"""`python -m jaxinfer.bench.pipeline`: one workload at pp = 1, 2, 4: the bubble, throughput, memory, latency.

    python -m jaxinfer.bench.pipeline                    # random-weight ~125M Llama (12 layers), pp 1 2 4
    python -m jaxinfer.bench.pipeline --pp 1 2 --json

For each pp, on the first pp devices (one stage per device, nothing else split):
- batch-1 latency: one request alone, decode ms per token (decode-only steps, compilation excluded).
  A pipeline cannot speed one request up: each of its tokens passes the P stages in P steps, one stage
  busy at a time; the slowdown against pp=1 is the cost of the per-step overhead and the activation hop.
- throughput: a burst of --requests requests, output tokens/s over the wall time of the whole run
  (after a warm-up run with the same shapes, so nothing compiles inside it).
- utilisation measured: stage-steps whose stage held a microbatch with work, over all stage-steps, in the
  burst run; against the formula N*M / (N*M + K*(P-1)) with N = K = 1 and M = the microbatches fed in
  (steps that took new work): what M microbatches fed back to back, with no step left empty, would give.
- device idle: the fraction of the burst's wall time the device waited for the host (EngineStats.device_idle);
  overlapped scheduling (the default; --no-overlap for the synchronous loop) hides the host's work behind
  the device's.
- weights per device: the largest device's shards (layers / pp, plus the embedding and the LM head,
  which every stage holds); KV bytes per page and token capacity per device.
On CPU all fake devices share the host's cores, so stages do not run in parallel as on accelerators: the
tokens/s here measure the schedule and its overheads, not the pipeline's speed-up.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from jaxinfer.bench.decode import PRESETS
from jaxinfer.cli import DTYPES, bench_command
from jaxinfer.config import EngineConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the random-weight "
                   "~125M Llama BENCH_100M, 12 layers)")
    p.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4], help="pipeline sizes to compare")
    p.add_argument("--sp", type=int, default=1, help="sequence parallel size under every pipeline")
    p.add_argument("--requests", type=int, default=16, help="requests in the burst")
    p.add_argument("--prompt-len", type=int, default=32, help="synthetic prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=32, help="generated tokens per request")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="default float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    EngineConfig.add_cli_args(p)
    args = p.parse_args(argv)
    args.mesh = f"pp={max(args.pp)},sp={args.sp}"  # the devices the largest pipeline needs
    return args


def generate(llm, prompts: list[list[int]], max_tokens: int):
    """(stats of the run, wall seconds, output tokens)."""
    from jaxinfer.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    before = llm.engine.stats.copy()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return llm.engine.stats - before, time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def bench_pp(path, pp: int, args: argparse.Namespace, dtype: str) -> dict:
    import jax

    from jaxinfer.device.kv_cache import page_bytes
    from jaxinfer.llm import LLM
    from jaxinfer.sharding import device_bytes

    llm = LLM(path, mesh=f"pp={pp},sp={args.sp}", dtype=dtype, engine_config=EngineConfig.from_cli_args(args))
    rng = np.random.default_rng(args.seed)
    prompts = lambda n: rng.integers(0, llm.config.vocab_size, (n, args.prompt_len)).tolist()  # noqa: E731
    generate(llm, prompts(1), args.max_tokens)                          # warm-up: compiles
    alone, _, _ = generate(llm, prompts(1), args.max_tokens)
    generate(llm, prompts(args.requests), args.max_tokens)
    burst, seconds, tokens = generate(llm, prompts(args.requests), args.max_tokens)
    w, engine = llm.weights, llm.engine
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(w.layers)) // pp
    ends = sum(x.nbytes for x in jax.tree.leaves((w.embed, w.head)))
    per_page = page_bytes(w.stage_layers, engine.kv_heads, engine.config.page_size, llm.config.head_dim, llm.dtype,
                          engine.config.kv_cache_dtype)
    M, P = burst.microbatches, pp
    report = llm.collective_report().get("decode", {}).get("collective-permute", {"count": 0, "bytes": 0})
    return {
        "pp": pp, "layers_per_stage": w.stage_layers,
        "weight_bytes_per_device": max(device_bytes(w, d) for d in llm.layout.mesh.devices.flat),
        "layer_bytes_per_device": layer_bytes, "embed_and_head_bytes_per_device": ends,
        "kv_bytes_per_page_per_device": per_page, "kv_pages_per_device": engine.pages_per_replica,
        "batch1_ms_per_token": 1e3 * alone.decode_seconds / alone.decode_tokens,
        "burst_tokens_per_second": tokens / seconds, "burst_seconds": seconds, "burst_steps": burst.steps,
        "microbatches": M, "utilisation": burst.utilisation, "utilisation_formula": M / (M + P - 1),
        "device_idle": burst.device_idle,
        "decode_collective_permute": report,
    }


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxinfer import random_model

    cache_name, config_name = PRESETS["dense"]
    path = args.model or random_model.ensure(cache_name, getattr(random_model, config_name))
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    results = [bench_pp(path, pp, args, dtype) for pp in args.pp]
    base = results[0]
    for r in results:
        r["batch1_slowdown"] = r["batch1_ms_per_token"] / base["batch1_ms_per_token"]
        r["burst_speedup"] = r["burst_tokens_per_second"] / base["burst_tokens_per_second"]
    return {"model": str(path), "label": f"{config_name} (random weights)" if args.model is None else str(path),
            "dtype": jnp.dtype(dtype).name, "platform": jax.devices()[0].platform, "requests": args.requests,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "overlap": args.overlap, "sp": args.sp,
            "results": results}


def readable(r: dict) -> str:
    lines = [f"model     {r['label']}, {r['dtype']} on {r['platform']}, sp={r['sp']}; burst of {r['requests']} "
             f"requests, prompt {r['prompt_len']} tokens, {r['max_tokens']} generated each",
             f"{'pp':>3} {'util':>6} {'formula':>7} {'idle':>5} {'burst tok/s':>11} {'x pp=1':>6} {'b1 ms/tok':>9} "
             f"{'x pp=1':>6} "
             f"{'weights MiB/dev':>15} {'KV KiB/page/dev':>15} {'permute B/step':>14}"]
    for x in r["results"]:
        lines.append(f"{x['pp']:>3} {x['utilisation']:>6.3f} {x['utilisation_formula']:>7.3f} {x['device_idle']:>5.3f} "
                     f"{x['burst_tokens_per_second']:>11.1f} {x['burst_speedup']:>6.2f} "
                     f"{x['batch1_ms_per_token']:>9.2f} "
                     f"{x['batch1_slowdown']:>6.2f} {x['weight_bytes_per_device'] / 2**20:>15.1f} "
                     f"{x['kv_bytes_per_page_per_device'] / 2**10:>15.1f} "
                     f"{x['decode_collective_permute']['bytes']:>14,}")
    lines.append("util = busy stage-steps / stage-steps in the burst; formula = M/(M+P-1), M = microbatches fed in; "
                 f"idle = the device's share of the burst waiting for the host ({'over' if r['overlap'] else 'un'}"
                 "lapped scheduling)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_command(parse_args(argv), run, readable)


if __name__ == "__main__":
    sys.exit(main())
