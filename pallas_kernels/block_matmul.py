"""A matmul with block-wise quantized weights: y = x @ (values * scales), values [K, N] int8 or float8_e4m3fn,
scales [K / block, N] float32 (one per `block` rows of the contraction and output column: DeepSeek's and
Qwen3's FP8 checkpoints, compressed-tensors' block strategy), one Triton program per [block_m, block_n] tile of y.

Why a kernel: each contraction block's product must be scaled before the blocks are summed, and XLA cannot
fuse that into its GEMM. It writes every block's float32 product, [K / block, T, N] for T rows, and reads it
back: as many bytes as the weight itself at 32 rows (jaxinfer.quant.matmul, the reference). The kernel scales
each block's product in registers as it accumulates, so a call reads the weight once and writes only y.

Per program, for each block of K: a [block_m, block] tile of x and a [block, block_n] tile of the values.
Weight-only: the values converted to x's dtype (exact: every int8 and e4m3 value is a bfloat16), a dot
accumulated in float32, times the block's scales. With `fp8_activations` (fp8 values, GPUs with fp8 tensor
cores): the x tile quantized to e4m3 with one scale per row, amax / 448 (per row and block: DeepSeek's 1 x 128
activation tiles, the dynamic scheme those checkpoints declare), an fp8 dot, times both scales. The products
are summed in float32 and y rounded once to x's dtype: jaxinfer.quant.matmul and jaxinfer.quant.fp8_matmul
compute the same, up to the order of float32 additions.

Triton needs power-of-two tiles: `block` a power of two of at least 16 and N a multiple of 16 (`fits`); rows
are padded to block_m (at least 16, Triton's smallest dot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

FP8_MAX = 448.0


def fits(k: int, n: int, block: int) -> bool:
    """Whether the kernel takes a [k, n] weight in blocks of `block` rows."""
    return block >= 16 and block & (block - 1) == 0 and k % block == 0 and n % 16 == 0


def tile(size: int, largest: int) -> int:
    """The largest power of two of at most `largest` that divides `size` (at least 16)."""
    tile = largest
    while size % tile:
        tile //= 2
    return tile


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [m, k] -> (e4m3 values, float32 scales [m, 1]): one scale per row, amax / 448 (1 where a row is 0)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (x32 / scale).astype(jnp.float8_e4m3fn), scale


def block_product(x: jax.Array, w: jax.Array, scale: jax.Array | None, *, fp8_activations: bool) -> jax.Array:
    """One contraction block's float32 product x [m, block] @ w [block, n], times its scales [1, n] (None:
    unscaled): w converted to x's dtype (plain weights: the wider dtype of the two; float32 operands multiplied
    in float32, not Triton's default TF32), or with `fp8_activations` x quantized to e4m3 per row and an fp8
    dot scaled by x's scales too; e4m3 x (already quantized) meets e4m3 w in an fp8 dot. Shared by the kernels
    that loop over a weight's contraction in blocks."""
    if fp8_activations:
        xq, x_scale = quantize_rows(x)
        product = jnp.dot(xq, w, preferred_element_type=jnp.float32) * x_scale
    elif x.dtype == jnp.float8_e4m3fn:   # rows quantized before the kernel, their scales applied after it
        product = jnp.dot(x, w, preferred_element_type=jnp.float32)
    else:   # 8-bit values convert exactly to x's dtype; plain weights meet x in the wider of the two
        dtype = x.dtype if w.dtype.itemsize == 1 else jnp.promote_types(x.dtype, w.dtype)
        product = jnp.dot(x.astype(dtype), w.astype(dtype), precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    return product if scale is None else product * scale


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block: int, fp8_activations: bool):
    def step(i, acc):
        x = x_ref[:, pl.ds(i * block, block)]                  # [block_m, block]
        w = w_ref[pl.ds(i * block, block), :]                  # [block, block_n]
        scale = s_ref[pl.ds(i, 1), :]                          # [1, block_n]
        return acc + block_product(x, w, scale, fp8_activations=fp8_activations)

    blocks = x_ref.shape[1] // block
    acc = lax.fori_loop(0, blocks, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block", "fp8_activations", "interpret"))
def block_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, *, block: int, fp8_activations: bool = False,
                 interpret: bool = False) -> jax.Array:
    """x [T, K] times values [K, N] (int8 or float8_e4m3fn) with scales [K / block, N] -> [T, N] in x's dtype.
    fp8_activations: x quantized to e4m3 per row and block, fp8 dots (fp8 values only)."""
    t, k = x.shape
    n = values.shape[1]
    if not fits(k, n, block):
        raise ValueError(f"block_matmul takes a [K, N] weight in blocks of a power of two >= 16 rows that divides K, "
                         f"N a multiple of 16; got [{k}, {n}] in blocks of {block}")
    if scale.shape != (k // block, n):
        raise ValueError(f"scale {scale.shape} for a [{k}, {n}] weight in blocks of {block}: want {(k // block, n)}")
    if fp8_activations and values.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_activations needs float8_e4m3fn values, not {values.dtype}")
    block_m = min(64, max(16, pl.next_power_of_2(t)))
    block_n = tile(n, 128)
    rows = pl.cdiv(t, block_m) * block_m
    out = pl.pallas_call(
        functools.partial(_kernel, block=block, fp8_activations=fp8_activations),
        grid=(rows // block_m, n // block_n),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
                  pl.BlockSpec((k // block, block_n), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(jnp.pad(x, ((0, rows - t), (0, 0))), values, scale)
    return out[:t]
