"""Quantized KV pages: how a K or V vector is stored as int8 or float8_e4m3fn, and read back.

One scale per written vector (a token's K or V of one KV head, head_dim values), symmetric, bfloat16
(jaxinfer/device/kv_cache.py says why that granularity). Every backend computes the same values with the
same rounding, so a kernel's pages equal its reference's bit for bit:

    amax  = max |x| over head_dim, in float32 (x in the model's dtype; k after RoPE, cast to k's dtype)
    scale = bfloat16(amax * f32(1 / QMAX)), round to nearest even; 1 where that is 0 (or NaN): an all-zero
            vector stores zeros, never 0 / 0
    y     = x * f32(1 / scale)
    int8:  q = clip(rne(y), -127, 127)                  QMAX = 127
    fp8:   q = e4m3fn(clip(y, -448, 448))              QMAX = 448, round to nearest even in the cast
    read:  x' = (float32(q) * float32(scale)) cast to the model's dtype

The scale is rounded to bfloat16 *before* quantizing, so the stored scale is the one quantized against and
dequantizing is exact in float32 (q has at most 7 significant bits, the scale 8). The clip catches the
rare vector whose scale rounded down: y then exceeds QMAX by at most 2^-8 relative, less than
half a step. Multiplications by reciprocals, not divisions: XLA rewrites a division by a broadcast value
into one (rounding the reciprocal), which would move ties; written so, every backend computes the same
products. rne is round half to even of the rounded product: jnp.round under XLA (and Pallas' interpret
mode), PTX cvt.rni in the Triton kernel (its lowering has no round), nearbyint in C++. Not the add-and-
subtract of 1.5 * 2^23: compilers contract the product into that add (an FMA, XLA:CPU's and Triton's
fusions do), which rounds the unrounded product, so a product that rounds onto a tie would go either way.

Error per element (what the tests bound attention's error with; rounding the reciprocal and the product
moves y by at most 2^-23 |y|, below 2^-16 of a step): int8 |x - x'| <= scale / 2 ~ amax / 254;
e4m3fn keeps 3 mantissa bits, |x - x'| <= 2^-4 |x| for |x| / scale >= 2^-6, else <= scale * 2^-10
(its subnormal step is 2^-9); casting x' to a bfloat16 model adds at most 2^-9 |x'|.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}   # EngineConfig.kv_cache_dtype -> page element type
SCALE_DTYPE = jnp.bfloat16
Round = Callable[[jax.Array], jax.Array]


def is_quantized(dtype) -> bool:
    """Whether pages of this element type hold quantized vectors (and scale arrays come with them)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def qmax(dtype) -> float:
    """The largest magnitude a quantized element holds: the vector's amax maps to it."""
    return 127.0 if jnp.dtype(dtype) == jnp.dtype(jnp.int8) else 448.0


def scale_of(amax: jax.Array, dtype) -> jax.Array:
    """float32 amax [..., 1] -> the stored bfloat16 scale (1 where the vector is all zeros)."""
    scale = (amax * jnp.float32(1.0 / qmax(dtype))).astype(SCALE_DTYPE).astype(jnp.float32)
    return jnp.where(scale > 0, scale, 1.0).astype(SCALE_DTYPE)


def quantize_with(x: jax.Array, scale: jax.Array, dtype, rne: Round = jnp.round) -> jax.Array:
    """x (float32) against its stored scale (broadcasting) -> elements of `dtype`. rne: round half to even
    (a kernel's own where its lowering lacks jnp.round)."""
    y = x * (1.0 / scale.astype(jnp.float32))
    top = qmax(dtype)
    if jnp.dtype(dtype) == jnp.dtype(jnp.int8):
        y = rne(y)
    return jnp.minimum(jnp.maximum(y, -top), top).astype(dtype)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] (any float dtype) -> (elements [..., D] of `dtype`, bfloat16 scales [..., 1])."""
    x = x.astype(jnp.float32)
    scale = scale_of(jnp.max(jnp.abs(x), axis=-1, keepdims=True), dtype)
    return quantize_with(x, scale, dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Stored elements and their scales (broadcasting) -> values in `dtype` (the model's)."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)
