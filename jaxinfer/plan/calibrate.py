"""`python -m jaxinfer.plan --calibrate`: this machine's figures for the planner's "cpu" device kind, measured
with every one of N devices busy at once and stored as the host's (N times a device's share; the planner
splits them over the devices of a mesh, jaxinfer.plan.hardware):
- memory bandwidth: a sum over a float32 array of 32 MiB per device (bigger than the caches);
- matmul rate per weight dtype: [256, 1024] x [1024, 1024] per device, float32 and bfloat16 as XLA multiplies
  them; on CPU, bfloat16, int8 and fp8 weights again as the engine holds and multiplies them (the C++ matmul,
  jaxinfer.device.matmul), which the planner takes;
- weight read rate per weight dtype (CPU): bytes/s of one-row matmuls by [4096, 4096] weights per device, as
  the engine runs them: decode's matmuls, where the C++ matmul's conversion of each 1- or 2-byte weight, not
  only the memory, sets the pace. The weights are distinct, 128 MiB of them a device, multiplied one after
  another as a model's layers are: one weight multiplied again and again is read from the L3 cache (16.7 MB
  of int8 fit in 32 MiB), which made bfloat16 weights look 1.5x faster than they run;
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
from typing import Any

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


def _probe(devices: list):
    """A layout with one replica per device, and x's sharding on it."""
    from jaxinfer.mesh import MeshConfig
    from jaxinfer.sharding import Layout

    layout = Layout(MeshConfig(dp=len(devices)).make(devices))
    return layout, layout.sharding(("batch", None, None))


def held_weight(layout, dtype: str, k: int, key: int = 1) -> Any:
    """A [k, k] weight of `dtype` ("float32", "bfloat16", "int8", "fp8") on every device, held as the engine
    holds a model's on CPU (jaxinfer.device.matmul.kernel_weights: the 16-bit one with unit scales)."""
    from jaxinfer.checkpoint import ParamSpec
    from jaxinfer.device.matmul import kernel_weights
    from jaxinfer.quant import quantize

    axes = ("embed", "mlp")
    w = jax.random.normal(jax.random.key(key), (k, k), jnp.float32) * 0.02
    w = quantize(w, dtype, contract=1, out=1, axes=axes) if dtype in ("int8", "fp8") else w.astype(dtype)
    w = jax.device_put(w, layout.sharding(()))
    return kernel_weights(w, ParamSpec((k, k), axes, "w", contract=1), layout, "cpu")


def _x(dtype: str, shape: tuple, sharding) -> jax.Array:
    """Activations in float32, bfloat16 for a bfloat16 weight (a bfloat16 model's)."""
    x_dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    return jax.device_put(jax.random.normal(jax.random.key(0), shape, x_dtype), sharding)


def engine_matmul(devices: list, dtype: str, m: int, k: int) -> tuple[Callable, jax.Array, Any]:
    """One [m, k] x [k, k] matmul per device, every device at once, by a weight of `dtype` held and multiplied
    as the engine holds and multiplies a model's on CPU: float32 by XLA's dot, the others by the C++ matmul, in
    jaxinfer.device.matmul. Returns (jitted fn, x, w)."""
    from jaxinfer.device.matmul import model_matmul

    layout, rows = _probe(devices)
    x = _x(dtype, (len(devices), m, k), rows)
    return jax.jit(lambda x, w: model_matmul(x, w, 1, layout, "cpu")), x, held_weight(layout, dtype, k)


def weight_chain(devices: list, dtype: str, k: int, total: int) -> tuple[Callable, jax.Array, list]:
    """One-row matmuls by distinct [k, k] weights of `dtype` (`engine_matmul`'s), `total` bytes or more of them a
    device, each waiting for the one before, as a model's layers do: the weights come from memory, not the
    caches. Returns (jitted fn, x, weights)."""
    from jaxinfer.device.matmul import model_matmul

    layout, rows = _probe(devices)
    copies = max(2, -(-total // weight_bytes(dtype, k)))
    weights = [held_weight(layout, dtype, k, key=1 + i) for i in range(copies)]

    def layers(x, weights):
        for w in weights:
            x = x + (model_matmul(x, w, 1, layout, "cpu") * 0).astype(x.dtype)
        return x

    return jax.jit(layers), _x(dtype, (len(devices), 1, k), rows), weights


def weight_read_rate(devices: list, dtype: str, k: int = 4096, total: int = 128 << 20) -> float:
    """Bytes/s per device at which decode's one-row matmuls read weights of `dtype` (`weight_chain`), every
    device at once."""
    f, x, weights = weight_chain(devices, dtype, k, total)
    return weight_bytes(dtype, k) * len(weights) / queued_seconds(lambda: f(x, weights))


def engine_matmul_seconds(devices: list, dtype: str, m: int, k: int) -> float:
    """`engine_matmul`'s time: a rate (queued calls)."""
    mm, x, w = engine_matmul(devices, dtype, m, k)
    return queued_seconds(lambda: mm(x, w))


def weight_bytes(dtype: str, k: int) -> int:
    """A [k, k] weight's bytes as the engine holds it, scales included."""
    return k * k * {"float32": 4, "bfloat16": 2, "int8": 1, "fp8": 1}[dtype] + (4 * k if dtype != "float32" else 0)


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
    rates = {"float32": devices * f["matmul_flops"]["float32"]}
    m, k = 256, 1024
    for dtype in ("bfloat16", "int8", "fp8"):
        rates[dtype] = devices * 2 * m * k * k / engine_matmul_seconds(cpus[:devices], dtype, m, k)
    reads = {dtype: devices * weight_read_rate(cpus[:devices], dtype)
             for dtype in ("float32", "bfloat16", "int8", "fp8")}
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    kind = DeviceKind("cpu", memory / devices, devices * f["memory_bandwidth"], rates,
                      link_bandwidth=f.get("link_bandwidth", 1e12), link_latency=f.get("link_latency", 0.0),
                      step_overhead=f["step_overhead"],
                      source=f"calibrated {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores, {devices} devices",
                      shared=True, weight_read=reads)
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = json.loads(path.read_text()) if path.is_file() else {}
    stored[str(devices)] = kind.to_json()
    path.write_text(json.dumps(stored, indent=1))
    return kind
