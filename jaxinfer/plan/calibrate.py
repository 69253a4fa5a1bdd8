"""`python -m jaxinfer.plan --calibrate`: this machine's figures for the planner's "cpu" device kind, measured
with every one of N devices busy at once and stored as the host's (N times a device's share; the planner
splits them over the devices of a mesh, jaxinfer.plan.hardware):
- memory bandwidth: a sum over a float32 array of 32 MiB per device (bigger than the caches);
- matmul rate per weight dtype: [256, 1024] x [1024, 1024] per device in float32 and bfloat16; int8 and fp8
  weights, which XLA:CPU has no units for, at the rate of their bfloat16 matmul after a dequantize;
- collectives: an all-reduce over all N devices of 4 bytes (the latency) and of 4 MiB (the bandwidth);
- step overhead: a decode step of a one-layer model 64 wide on one device (the engine's host work per step:
  schedule, pack, dispatch, fetch).
Each figure is the best of a few repetitions. Stored in jaxinfer.plan.hardware.calibration_path() by device count.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.plan.hardware import DeviceKind, calibration_path

REPEATS = 5


def best_seconds(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """One call's best time, waited for alone: a latency."""
    jax.block_until_ready(fn())   # compile, warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def queued_seconds(fn: Callable[[], object], repeats: int = REPEATS, rounds: int = 2) -> float:
    """One call's time when `repeats` calls are queued back to back and waited for once, best of `rounds`: a
    rate, with the dispatch of one call hidden behind the device's work on the last (on one H200, a 1 GiB
    sum waited for alone gave 2.96 TB/s; the decode benchmark's queued sum of 2 GiB, 4.32)."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready([fn() for _ in range(repeats)])
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def _sharded(mesh, shape, dtype, key=0):
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    return jax.jit(lambda: jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype),
                   out_shardings=sharding)()


def memory_bandwidth(mesh, n: int, words: int = 8 << 20) -> float:
    """words: float32 per device (32 MiB: bigger than a CPU's caches)."""
    x = _sharded(mesh, (n, words), jnp.float32)
    total = jax.jit(lambda x: jnp.sum(x, axis=1))
    return words * 4 / queued_seconds(lambda: total(x))


def matmul_rate(mesh, n: int, dtype, m: int = 256, k: int = 1024) -> float:
    a, b = _sharded(mesh, (n, m, k), dtype), _sharded(mesh, (n, k, k), dtype, key=1)
    mm = jax.jit(lambda a, b: jnp.einsum("nmk,nkj->nmj", a, b, preferred_element_type=jnp.float32))
    return 2 * m * k * k / queued_seconds(lambda: mm(a, b))


def all_reduce_seconds(mesh, n: int, words: int) -> float:
    x = _sharded(mesh, (n, words), jnp.float32)
    reduce = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=PartitionSpec("d"),
                                   out_specs=PartitionSpec("d")))
    return best_seconds(lambda: reduce(x))


def measure(devices: list, words: int = 8 << 20, m: int = 256, k: int = 1024) -> dict:
    """The figures of `devices` (any platform), each device busy at once: per device, except the collectives'.
    words, m and k size the bandwidth and matmul probes (an accelerator needs larger ones than the defaults,
    which are a CPU's)."""
    n = len(devices)
    mesh = jax.make_mesh((n,), ("d",), devices=devices)
    figures = {"memory_bandwidth": memory_bandwidth(mesh, n, words),
               "matmul_flops": {"float32": matmul_rate(mesh, n, jnp.float32, m, k),
                                "bfloat16": matmul_rate(mesh, n, jnp.bfloat16, m, k)},
               "step_overhead": step_overhead(n)}
    if n > 1:
        small, large = all_reduce_seconds(mesh, n, 1), all_reduce_seconds(mesh, n, 1 << 20)
        figures.update(link_latency=small, link_bandwidth=(4 << 20) / max(large - small, 1e-9))
    return figures


def step_overhead(devices: int) -> float:
    from jaxinfer.llm import LLM
    from jaxinfer.sampling import SamplingParams

    config = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    with LLM.random(config, mesh=f"dp={devices}", dtype="float32", num_pages=16, compilation_cache=False) as llm:
        params = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
        llm.generate([[1, 2, 3]], params)                      # compiles
        t0 = time.perf_counter()
        llm.generate([[1, 2, 3]], params)
        return (time.perf_counter() - t0) / params.max_tokens


def calibrate(devices: int) -> DeviceKind:
    """Measure on `devices` CPU devices (set up by the caller before JAX starts) and store the result."""
    cpus = jax.devices("cpu")
    if len(cpus) < devices:
        raise ValueError(f"calibrating for {devices} devices needs that many CPU devices, JAX has {len(cpus)}")
    f = measure(cpus[:devices])
    bf16 = devices * f["matmul_flops"]["bfloat16"]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    kind = DeviceKind("cpu", memory / devices, devices * f["memory_bandwidth"],
                      {"float32": devices * f["matmul_flops"]["float32"], "bfloat16": bf16, "int8": bf16, "fp8": bf16},
                      link_bandwidth=f.get("link_bandwidth", 1e12), link_latency=f.get("link_latency", 0.0),
                      step_overhead=f["step_overhead"],
                      source=f"calibrated {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores, {devices} devices",
                      shared=True)
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = json.loads(path.read_text()) if path.is_file() else {}
    stored[str(devices)] = kind.to_json()
    path.write_text(json.dumps(stored, indent=1))
    return kind
