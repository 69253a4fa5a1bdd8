"""`python -m jaxinfer.bench.quant`: what quantized weights and KV pages cost and buy, in one run.

For each variant (weights float32, bfloat16, int8, fp8; KV pages int8, fp8 under float32 weights): bytes
of weights per device, the KV tokens a GiB of pool holds (the engine's own page sizing, scales counted),
batch-1 decode tok/s, its ratio to float32's and (where bfloat16 is among the variants) to bfloat16's, and
its MBU (jaxinfer.bench.decode: the bytes a step actually reads, 1-byte weights counted as such), and the
accuracy cost against the float32 model on the same prompts, teacher-forced: per-token KL divergence (mean
and max; MaxText's logit checker gates on a max of 0.02), the largest logit error, and greedy agreement
(the share of positions whose argmax is the float32 model's). Every variant's model is held at once and their
decode runs take turns, `--rounds` times: the tok/s is a variant's median, its ratios the medians of the ratios
within a round (and their range), so a busy spell of a shared machine moves every variant alike.
Beside each measured decode tok/s, the layout planner's prediction for it (`predicted_decode`: one sequence,
this device kind's figures, jaxinfer.plan), so the roofline's cost of each weight dtype is held against the
engine in the same run.

`weight_matmuls` times one weight's matmul in each form alone (the GPU check runs it).
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import re
import statistics
import time

import numpy as np

from jaxinfer.cli import bench_command

VARIANTS = {  # name: (serving dtype, weight quantization, KV cache dtype)
    "float32": ("float32", None, "auto"),
    "bfloat16": ("bfloat16", None, "auto"),
    "int8": ("float32", "int8", "auto"),
    "fp8": ("float32", "fp8", "auto"),
    "bf16-int8": ("bfloat16", "int8", "auto"),   # a bfloat16 checkpoint served with --quantization int8
    "bf16-fp8": ("bfloat16", "fp8", "auto"),
    "kv-int8": ("float32", None, "int8"),
    "kv-fp8": ("float32", None, "fp8"),
}


def accuracy(logits: list[np.ndarray], reference: list[np.ndarray]) -> dict:
    """Per-token KL(reference || ours), max |logit error| and argmax agreement over every position."""
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    ours, ref = np.concatenate(logits), np.concatenate(reference)
    p, q = log_softmax(ref.astype(np.float64)), log_softmax(ours.astype(np.float64))
    kl = (np.exp(p) * (p - q)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "max_logit_error": float(np.abs(ours - ref).max()),
            "greedy_agreement": float((ours.argmax(-1) == ref.argmax(-1)).mean()), "positions": len(kl)}


def run(args: argparse.Namespace) -> dict:
    from jaxinfer import random_model
    from jaxinfer.bench import decode
    from jaxinfer.bench.peers import bench_prompts
    from jaxinfer.config import EngineConfig
    from jaxinfer.llm import LLM

    random_weights = args.model is None
    cache_name, config_name = decode.PRESETS[args.preset]
    path = random_model.ensure(cache_name, getattr(random_model, config_name)) if random_weights else args.model
    bandwidth = decode.memory_bandwidth(args.bandwidth_mib)
    page = EngineConfig().page_size   # pools for the prompts alone: every variant's model is held at once
    pages = 2 * args.prompts * -(-(args.prompt_len + args.max_tokens) // page) + 16
    llms, rows, reference = {}, [], None
    try:
        for name in ["float32", *[v for v in args.variants if v != "float32"]]:
            dtype, quantization, kv = VARIANTS[name]
            llm = llms[name] = LLM(path, mesh=args.mesh, dtype=dtype, quantization=quantization,
                                   kv_cache_dtype=kv, num_pages=pages)
            _, prompts = bench_prompts(llm.config.vocab_size, args.prompts, args.prompt_len, args.seed)
            logits = llm.logits(prompts)
            reference = reference or logits
            context = args.prompt_len + args.max_tokens / 2   # the decode steps' average: the first token is prefill's
            rows.append({"variant": name, "dtype": dtype, "quantization": quantization, "kv_cache_dtype": kv,
                         "weight_bytes_per_device": llm.parameter_bytes_per_device(),
                         "kv_bytes_per_token": llm.engine.kv_bytes_per_token,
                         "kv_tokens_per_gib": 2**30 // llm.engine.kv_bytes_per_token,
                         "predicted_decode_tokens_per_second": predicted_decode(llm, args.prompt_len,
                                                                                args.max_tokens),
                         "weight_bytes_per_step": decode.weight_bytes_read(llm, 1),
                         "kv_bytes_per_step": decode.kv_bytes_read(llm, 1, context),
                         **accuracy(logits, reference)})
        rounds = decode_rounds(llms, args.prompt_len, args.max_tokens, args.seed, args.rounds)
    finally:
        for llm in llms.values():
            llm.close()
        llms.clear()
        gc.collect()
    for r in rows:
        r["decode_rounds"] = rounds[r["variant"]]
        r["decode_tokens_per_second"] = statistics.median(r["decode_rounds"])
        step_bytes = r["weight_bytes_per_step"] + r["kv_bytes_per_step"]   # a batch-1 step decodes one token
        r["mbu"] = step_bytes * r["decode_tokens_per_second"] / decode.GB / bandwidth
    for r in ratios(rows):
        r["kv_tokens_ratio"] = r["kv_tokens_per_gib"] / rows[0]["kv_tokens_per_gib"]
    return {"model": str(path), "random_weights": random_weights, "mesh": args.mesh or "one device",
            "memory_bandwidth_gbps": bandwidth, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "rounds": args.rounds, "rows": rows}


def decode_rounds(llms: dict, prompt_len: int, max_tokens: int, seed: int, rounds: int) -> dict[str, list[float]]:
    """Each model's batch-1 decode tok/s, `rounds` times after a warm-up round (which compiles the decode steps),
    the models taking turns within each round: a busy spell of a shared machine falls on all of them alike, and
    each round's ratios are taken within it."""
    from jaxinfer.bench.peers import bench_prompts
    from jaxinfer.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    speeds = {name: [] for name in llms}
    for warm in [True] + [False] * rounds:
        for name, llm in llms.items():
            _, prompts = bench_prompts(llm.config.vocab_size, 1, prompt_len, seed)
            llm.engine.reset_prefix_cache()   # each run prefills its prompt afresh
            before = llm.engine.stats.copy()
            llm.generate(prompts, params)
            s = llm.engine.stats - before
            if not warm:
                speeds[name].append(s.decode_tokens / s.decode_seconds)
    return speeds


def predicted_decode(llm, prompt_len: int, max_tokens: int) -> float:
    """The planner's decode tok/s for one sequence of `llm` as it is served (its dtype, weight quantization, KV
    dtype and mesh; collectives from its compiled programs), on this machine's device kind: 1 / TPOT."""
    import jax

    from jaxinfer.mesh import MeshConfig
    from jaxinfer.plan import Workload
    from jaxinfer.plan.auto import local_device_kind
    from jaxinfer.plan.compiled import compile_layout
    from jaxinfer.plan.hardware import device_kind
    from jaxinfer.plan.planner import evaluate

    mesh, devices = llm.mesh_config, list(llm.layout.mesh.devices.flat)
    kind = device_kind(local_device_kind(devices[0]), len(jax.devices()))
    stored = llm.stored_quantization
    single = compile_layout(llm.config, MeshConfig(), llm.dtype, llm.engine.config, 1, devices, programs=False,
                            stored=stored)
    workload = Workload(prompt=prompt_len, output=max_tokens, concurrency=1)
    c = evaluate(llm.config, mesh, kind, workload, llm.dtype, llm.engine.config, single, mesh_devices=devices,
                 programs=mesh.size > 1, stored=stored)
    return 1 / c.estimate.tpot_s


def ratios(rows: list[dict]) -> list[dict]:
    """The rows (float32's first) with each one's decode tok/s over float32's (`speedup`) and over bfloat16's
    (`speedup_vs_bfloat16`, None without a bfloat16 row): the median over rounds of the ratio within a round
    (`decode_rounds`), and its least and greatest (`speedup_range`). Quantized weights are held to both."""
    def within_rounds(r: dict, base: dict) -> list[float]:
        return [a / b for a, b in zip(r["decode_rounds"], base["decode_rounds"], strict=True)]
    bf16 = next((r for r in rows if r["variant"] == "bfloat16"), None)
    for r in rows:
        speedups = within_rounds(r, rows[0])
        r["speedup"], r["speedup_range"] = statistics.median(speedups), (min(speedups), max(speedups))
        r["speedup_vs_bfloat16"] = None if bf16 is None else statistics.median(within_rounds(r, bf16))
    return rows


MATMULS = ("plain", "fp8 gemm, row-major", "fp8 gemm, contraction-minor", "int8, dequantize then matmul",
           "int8, matmul then scale (the engine's)", "fp8 in blocks, products per block",
           "fp8 in blocks, Pallas kernel (the engine's)")
COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} (?:transpose|copy)\(")


def copies(hlo: str) -> list[tuple[str, int]]:
    """(element type, elements) of every transpose and copy in a compiled program's text."""
    return [(dtype, math.prod(int(d) for d in dims.split(",") if d)) for dtype, dims in COPY.findall(hlo)]


def one_byte_copies(hlo: str) -> dict:
    """The transposes and copies of 1-byte arrays (quantized weights, or fp8 activations) in a compiled
    program's text, and the bytes they write: what a step moves besides reading its weights once."""
    sizes = [n for dtype, n in copies(hlo) if dtype in ("f8e4m3fn", "s8")]
    return {"count": len(sizes), "bytes": sum(sizes)}


def weight_matmuls(k: int, n: int, rows: int, dtype: str, reps: int = 50) -> list[dict]:
    """One [K, N] weight's matmul on `rows` activation rows, on the default device, in each form the engine may
    run it (MATMULS: the plain weight in `dtype`; jaxinfer.quant.fp8_matmul on the fp8 weight stored row-major
    and stored as jaxinfer.device.matmul.gemm_layouts stores it; the int8 weight dequantized, then multiplied;
    and jaxinfer.quant.matmul on it: its values converted to `dtype` in the matmul and the per-channel scale
    applied to the product, which XLA:GPU fuses into one GEMM reading one byte per weight; the fp8 weight with
    one scale per block of 128 rows (of K, where K is smaller) and column, as DeepSeek-style checkpoints store
    it, by jaxinfer.quant.matmul's products per block and by the Pallas kernel, with fp8 activations where the
    GPU has fp8 tensor cores (jaxinfer.pallas_kernels.block_matmul; interpreted off a GPU)):
    us per matmul, the weight's bytes over that time (GB/s), and how many weight-sized transposes and copies
    the compiled program holds (what XLA adds around the GEMM). `reps` matmuls run in one call, each on the
    previous one's output, so neither the host's dispatch nor a hoisted loop-invariant product is measured."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.device.matmul import contraction_minor
    from jaxinfer.pallas_kernels.block_matmul import block_matmul
    from jaxinfer.quant import fp8_matmul, matmul, quantize

    kw, kx = jax.random.split(jax.random.key(0))
    w = jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5
    x = jax.random.normal(kx, (rows, k), dtype)
    fp8, int8 = quantize(w, "fp8", contract=1, out=1), quantize(w, "int8", contract=1, out=1)
    block = 128 if k % 128 == 0 else k
    blocks = fp8.replace(scale=jnp.broadcast_to(fp8.scale, (k // block, n)), block=block)
    device = jax.devices()[0]
    kernel = functools.partial(block_matmul, block=block, interpret=device.platform != "gpu",
                               fp8_activations=float(getattr(device, "compute_capability", 0) or 0) >= 9.0)
    forms = {MATMULS[0]: (lambda x, w: x @ w, w.astype(dtype)),
             MATMULS[1]: (fp8_matmul, fp8),
             MATMULS[2]: (fp8_matmul, fp8.replace(values=jax.device_put(fp8.values, contraction_minor(fp8)))),
             MATMULS[3]: (lambda x, q: x @ q.dequantize(x.dtype), int8),
             MATMULS[4]: (matmul, int8),
             MATMULS[5]: (matmul, blocks),
             MATMULS[6]: (lambda x, q: kernel(x, q.values, q.scale), blocks)}
    out = []
    for name, (mm, weight) in forms.items():
        def chain(x, weight, mm=mm):
            step = lambda i, x: x + 1e-3 * mm(x, weight)[:, :k].astype(x.dtype)   # noqa: E731
            return jax.lax.fori_loop(0, reps, step, x)
        f = jax.jit(chain)
        hlo = f.lower(x, weight).compile().as_text()
        jax.block_until_ready(f(x, weight))
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, weight))
        seconds = (time.perf_counter() - t0) / reps
        nbytes = sum(a.nbytes for a in jax.tree.leaves(weight))
        out.append({"form": name, "k": k, "n": n, "rows": rows, "us": 1e6 * seconds, "gbps": nbytes / seconds / 1e9,
                    "weight_copies": sum(size == k * n for _, size in copies(hlo))})
    return out


def readable(r: dict) -> str:
    lines = [f"model {r['model']}{' (random weights)' if r['random_weights'] else ''} on {r['mesh']}; batch-1 "
             f"decode of {r['max_tokens']} tokens after {r['prompt_len']}, medians of {r['rounds']} rounds (x f32's "
             f"range over them); accuracy against float32, teacher-forced",
             f"{'variant':<9} {'MiB/device':>10} {'KV tok/GiB':>10} {'decode tok/s':>12} {'x f32':>6} {'x bf16':>6} "
             f"{'range':>9} {'MBU':>6} {'predicted':>9} {'KL mean':>9} {'KL max':>9} {'max |dlogit|':>12} "
             f"{'greedy':>7}"]
    for x in r["rows"]:
        vs_bf16 = "-" if x["speedup_vs_bfloat16"] is None else f"{x['speedup_vs_bfloat16']:.2f}"
        low, high = x["speedup_range"]
        lines.append(f"{x['variant']:<9} {x['weight_bytes_per_device'] / 2**20:>10.1f} {x['kv_tokens_per_gib']:>10} "
                     f"{x['decode_tokens_per_second']:>12.1f} {x['speedup']:>6.2f} {vs_bf16:>6} "
                     f"{f'{low:.2f}-{high:.2f}':>9} {x['mbu']:>6.1%} "
                     f"{x['predicted_decode_tokens_per_second']:>9.1f} "
                     f"{x['kl_mean']:>9.2e} {x['kl_max']:>9.2e} {x['max_logit_error']:>12.4f} "
                     f"{x['greedy_agreement']:>7.1%}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.quant", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the --preset random-weight model)")
    p.add_argument("--preset", default="dense", choices=["dense", "moe"],
                   help="random-weight model when --model is not given: dense = ~125M Llama, moe = ~97M Mixtral "
                        "(8 experts, top-2)")
    p.add_argument("--mesh", default="")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--prompts", type=int, default=4, help="prompts scored for the accuracy figures")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5,
                   help="decode runs per variant, the variants taking turns (medians reported)")
    p.add_argument("--bandwidth-mib", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_command(parse_args(argv), run, readable)


if __name__ == "__main__":
    raise SystemExit(main())
