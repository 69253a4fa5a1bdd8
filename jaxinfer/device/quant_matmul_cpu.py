"""Weight-only quantized matmul (int8 or float8_e4m3fn weights, float32 scales) as a C++ kernel for XLA:CPU;
it reads bfloat16 and float16 weights too, which XLA:CPU's own dots multiply at about 1 GB/s.

Decode is memory-bound: each step reads every weight once, so 1-byte weights should make it up to four
times faster than float32. XLA:CPU does not get there on its own: it runs `convert(values) * scale`
followed by a dot by writing a float32 copy of the weight first. The kernel (quant_matmul_cpu.cc) reads the
1-byte weights once per call in their [K, N] layout, converts them in registers and applies each block's
scale to the block's partial sums, on XLA's intra-op threads when the call is large enough; its grouped form
multiplies a mixture's rows, grouped by expert, by each chosen expert as stored. It is built on
first use (jaxinfer/device/native.py); where it cannot be, `available()` is False and says why, and callers
keep `quantized_matmul_reference`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.device import native

SOURCE = Path(__file__).with_name("quant_matmul_cpu.cc")
TARGETS = {"jaxinfer_quantized_matmul": "QuantizedMatmul",
           "jaxinfer_grouped_quantized_matmul": "GroupedQuantizedMatmul"}
X_DTYPES = ("float32", "bfloat16", "float16")
VALUE_DTYPES = ("int8", "float8_e4m3fn", "bfloat16", "float16")

BuildError = native.BuildError


def _register() -> str | None:
    return native.register(SOURCE, TARGETS)


def available() -> bool:
    """Whether the kernel runs here: the first call builds it (seconds, once per machine and jaxlib)."""
    return _register() is None


def unavailable_reason() -> str | None:
    """Why the kernel does not run here (the compiler's or the loader's error), or None."""
    return _register()


def check(x: jax.Array, values: jax.Array, scale: jax.Array, block: int) -> None:
    """Raises ValueError, naming the shapes, unless the operands follow the contract of `quantized_matmul`."""
    if x.ndim != 2 or values.ndim != 2 or scale.ndim != 2:
        raise ValueError(f"quantized matmul takes x [M, K], values [K, N], scale [ceil(K / block), N]: "
                         f"got x {x.shape}, values {values.shape}, scale {scale.shape}")
    if not isinstance(block, int | np.integer) or block < 1:
        raise ValueError(f"quantized matmul: block must be a positive int, not {block!r}")
    k, n = x.shape[1], values.shape[1]
    if values.shape[0] != k or scale.shape != (-(-k // block), n):
        raise ValueError(f"quantized matmul: x {x.shape}, values {values.shape}, scale {scale.shape} with block "
                         f"{block}: need values [K={k}, N] and scale [ceil(K / block), N] = [{-(-k // block)}, {n}]")
    if jnp.dtype(values.dtype).name not in VALUE_DTYPES:
        raise ValueError(f"quantized matmul: values {values.shape} must be one of {VALUE_DTYPES}, not {values.dtype}")
    if jnp.dtype(x.dtype).name not in X_DTYPES:
        raise ValueError(f"quantized matmul: x {x.shape} must be one of {X_DTYPES}, not {x.dtype}")
    if jnp.dtype(scale.dtype) != jnp.float32:
        raise ValueError(f"quantized matmul: scale {scale.shape} must be float32, not {scale.dtype}")


def quantized_matmul_reference(x: jax.Array, values: jax.Array, scale: jax.Array, *, block: int) -> jax.Array:
    """The contract of `quantized_matmul` in jnp: the weight dequantized in float32, then a float32 dot."""
    check(x, values, scale, block)
    k = values.shape[0]
    weight = values.astype(jnp.float32) * jnp.repeat(scale, block, axis=0)[:k]
    out = jnp.dot(x.astype(jnp.float32), weight, precision=jax.lax.Precision.HIGHEST,
                  preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def quantized_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, *, block: int) -> jax.Array:
    """x [M, K] (float32, bfloat16 or float16) times the dequantized weight -> [M, N] in x's dtype, on one CPU device.

    values [K, N] int8 or float8_e4m3fn; scale [ceil(K / block), N] float32: weight[k, n] = values[k, n] *
    scale[k // block, n]. block == K is one scale per output column (per-channel); smaller blocks are block-wise
    scales along K (K need not be a multiple of block). Accumulates in float32.
    """
    check(x, values, scale, block)
    if reason := _register():
        raise BuildError(reason)
    call = jax.ffi.ffi_call("jaxinfer_quantized_matmul", jax.ShapeDtypeStruct((x.shape[0], values.shape[1]), x.dtype))
    return call(x, values, scale, block=np.int64(block))


def check_grouped(x: jax.Array, values: jax.Array, scale: jax.Array, sizes: jax.Array, block: int) -> None:
    """Raises ValueError, naming the shapes, unless the operands follow `grouped_quantized_matmul`'s contract."""
    if values.ndim != 3 or scale.ndim != 3 or sizes.shape != values.shape[:1] or sizes.dtype != jnp.int32:
        raise ValueError(f"grouped quantized matmul takes x [M, K], values [X, K, N], scale [X, ceil(K / block), N], "
                         f"sizes [X] int32: got x {x.shape}, values {values.shape}, scale {scale.shape}, sizes "
                         f"{sizes.shape} {sizes.dtype}")
    if scale.shape[0] != values.shape[0]:
        raise ValueError(f"grouped quantized matmul: values {values.shape} and scale {scale.shape} differ in experts")
    check(x, *(jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in (values, scale)), block)   # one expert's


def grouped_quantized_matmul_reference(x: jax.Array, values: jax.Array, scale: jax.Array, sizes: jax.Array, *,
                                       block: int) -> jax.Array:
    """The contract of `grouped_quantized_matmul` in jnp: each row times its group's dequantized expert, float32."""
    check_grouped(x, values, scale, sizes, block)
    ends = jnp.cumsum(sizes)
    expert = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")     # == X past the groups
    k = values.shape[1]
    weight = values.astype(jnp.float32) * jnp.repeat(scale, block, axis=1)[:, :k]
    out = jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), weight[jnp.minimum(expert, values.shape[0] - 1)],
                     precision=jax.lax.Precision.HIGHEST)
    return jnp.where((expert < values.shape[0])[:, None], out, 0).astype(x.dtype)


def grouped_quantized_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, sizes: jax.Array, *,
                             block: int) -> jax.Array:
    """x [M, K] (rows grouped by expert: `sizes[g]` rows of expert g, in order) times each group's expert
    -> [M, N] in x's dtype, rows past the groups 0, on one CPU device: a mixture of experts' product, which
    reads the experts that have rows, as stored. values [X, K, N] and scale [X, ceil(K / block), N] as in
    `quantized_matmul`, one per expert; sizes [X] int32 (groups past M rows are cut at M)."""
    check_grouped(x, values, scale, sizes, block)
    if reason := _register():
        raise BuildError(reason)
    call = jax.ffi.ffi_call("jaxinfer_grouped_quantized_matmul",
                            jax.ShapeDtypeStruct((x.shape[0], values.shape[2]), x.dtype))
    return call(x, values, scale, sizes, block=np.int64(block))


def parse_args(argv: list[str] | None = None):
    """The benchmark's command line (`python -m jaxinfer.device.quant_matmul_cpu --help`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jaxinfer.device.quant_matmul_cpu", description=_benchmark.__doc__)
    parser.add_argument("--m", default="1,8,64", help="rows of x")
    parser.add_argument("--shapes", default="768x768,768x2304,768x3072,768x6144,3072x768,4096x4096", help="K x N")
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args(argv)


def _benchmark(argv: list[str] | None = None) -> None:
    """Times the dots XLA runs (float32, bfloat16), the reference and the kernel (int8 and fp8 with per-channel
    scales; bfloat16) on one CPU device, each as a chain of dependent matmuls, one per copy of its weight, the
    copies 48 MB or more in all (more than the L3 cache, as a model's weights are). The variants of a shape
    take turns, and each keeps its best time: microseconds a matmul, and GB/s of weight bytes read."""
    import math
    import time

    import ml_dtypes

    args = parse_args(argv)
    rng, dev = np.random.default_rng(0), jax.devices("cpu")[0]
    int8, fp8, bf16 = np.dtype(np.int8), np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.bfloat16)
    variants = {"f32 dot": (np.dtype(np.float32), None), "bf16 dot": (bf16, None),
                "int8 reference": (int8, quantized_matmul_reference), "int8 kernel": (int8, quantized_matmul),
                "fp8 reference": (fp8, quantized_matmul_reference), "fp8 kernel": (fp8, quantized_matmul),
                "bf16 kernel": (bf16, quantized_matmul)}

    def chain(x, weights, scales, f, k):
        for w, s in zip(weights, scales, strict=True):   # one after the other, as layers are
            out = x @ w if f is None else f(x, w, s, block=k)
            x = x + (out[:, :1] * 0).astype(x.dtype)
        return out

    print(f"{'M':>3} {'K x N':>10} {'variant':>15} {'us/matmul':>10} {'GB/s':>6}")
    for k, n in (map(int, s.split("x")) for s in args.shapes.split(",")):
        runs = {}
        for name, (dtype, f) in variants.items():
            copies = max(2, math.ceil(48e6 / (k * n * dtype.itemsize)))
            weights = [jax.device_put((rng.standard_normal((k, n), np.float32) * (0.02 if f is None else 40)
                                       ).clip(-127, 127).astype(dtype), dev) for _ in range(copies)]
            scales = [jax.device_put(rng.uniform(1e-4, 2e-4, (1, n)).astype(np.float32), dev) for _ in weights]
            run = jax.jit(functools.partial(chain, f=f, k=k))
            for m in map(int, args.m.split(",")):
                x = jax.device_put(rng.standard_normal((m, k), np.float32).astype(np.float32 if f else dtype), dev)
                jax.block_until_ready(run(x, weights, scales))
                runs[m, name] = (functools.partial(run, x, weights, scales), copies, k * n * dtype.itemsize)
        best = dict.fromkeys(runs, math.inf)
        for _ in range(args.rounds):
            for key, (go, copies, _) in runs.items():
                start = time.perf_counter()
                jax.block_until_ready(go())
                best[key] = min(best[key], (time.perf_counter() - start) / copies)
        for (m, name), (_, _, nbytes) in sorted(runs.items(), key=lambda item: item[0][0]):
            t = best[m, name]
            print(f"{m:>3} {k:>5}x{n:<5} {name:>14} {t * 1e6:>10.1f} {nbytes / t / 1e9:>6.1f}", flush=True)


if __name__ == "__main__":
    _benchmark()
