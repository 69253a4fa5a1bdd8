"""The experts' grouped matmul of a mixture-of-experts layer: rows grouped by expert times each group's own
expert weight, plain or quantized (int8 or float8_e4m3fn values with scales per output channel or per block
of the contraction), one Triton program per [block_m, block_n] tile of the output.

Why a kernel: XLA:GPU lowers `lax.ragged_dot` to a GEMM per expert over a masked copy of every row, so a step
writes [experts, rows, K] and reads every expert, the ones no row chose included; quantized experts were
converted or dequantized before it. Here the output's row tiles are laid along the groups (vLLM's fused MoE
pads each expert's rows to its tile the same way), so a program multiplies one expert's rows by that expert's
weight tile: a call reads the experts its rows chose, each once per row tile, and writes only its output.

Per program, over the contraction in chunks (the scales' blocks where they are block-wise): a [block_m, chunk]
tile of the rows (masked to the group's) and a [chunk, block_n] tile of its expert's values, the product
accumulated in float32 as jaxinfer.pallas_kernels.block_matmul accumulates it (`block_product`): weight-only,
or with `fp8_activations` on fp8 values, fp8 dots on the rows quantized to e4m3 (per row and block in the
kernel for block-wise values; per row before it, over the whole contraction, for per-channel ones, whose row
and channel scales multiply the sum as jaxinfer.quant.fp8_matmul's). Rows past the groups come out 0.

Triton needs power-of-two tiles: the contraction a multiple of 16 (of `block`, a power of two >= 16, when
block-wise) and the output's columns a multiple of 16 (`fits`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas_kernels.block_matmul import block_product, quantize_rows, tile


def fits(k: int, n: int, block: int | None = None) -> bool:
    """Whether the kernel takes experts [X, k, n], unscaled or per channel (block None) or in blocks of
    `block` rows."""
    if block is None:
        return k % 16 == 0 and n % 16 == 0
    return block >= 16 and block & (block - 1) == 0 and k % block == 0 and n % 16 == 0


def _tile_map(sizes: jax.Array, rows: int, block_m: int, num_tiles: int) -> jax.Array:
    """int32 [num_tiles, 3]: each row tile's (group, first row, the group's end row). Group X (one past the
    experts) holds the rows after theirs; tiles past the last group's are -1."""
    groups = jnp.concatenate([sizes, (rows - sizes.sum())[None]]).astype(jnp.int32)
    start = jnp.cumsum(groups) - groups
    tiles = (groups + block_m - 1) // block_m
    tiles_end = jnp.cumsum(tiles)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(tiles_end, t, side="right"), groups.shape[0] - 1).astype(jnp.int32)
    first = start[g] + (t - (tiles_end[g] - tiles[g])) * block_m
    return jnp.stack([jnp.where(t < tiles_end[-1], g, -1), first, start[g] + groups[g]], axis=1)


def _kernel(tiles_ref, x_ref, w_ref, *refs, experts: int, block_m: int, block_n: int, chunk: int,
            per_block: bool, fp8_activations: bool):
    *scale_refs, o_ref = refs   # the values' scales, then (rows quantized before the kernel) the rows' own
    s_ref, r_ref = (*scale_refs, None, None)[:2]
    t, j = pl.program_id(0), pl.program_id(1)
    group, first, end = tiles_ref[t, 0], tiles_ref[t, 1], tiles_ref[t, 2]
    rows, cols = pl.ds(first, block_m), pl.ds(j * block_n, block_n)
    in_group = ((first + jnp.arange(block_m)) < end)[:, None]
    out_mask = jnp.broadcast_to(in_group, (block_m, block_n))

    @pl.when(group == experts)      # the rows past the groups
    def _():
        plgpu.store(o_ref.at[rows, cols], jnp.zeros((block_m, block_n), o_ref.dtype), mask=out_mask)

    @pl.when((group >= 0) & (group < experts))
    def _():
        in_mask = jnp.broadcast_to(in_group, (block_m, chunk))

        def step(i, acc):
            x = plgpu.load(x_ref.at[rows, pl.ds(i * chunk, chunk)], mask=in_mask, other=0.0)
            w = w_ref[group, pl.ds(i * chunk, chunk), cols]
            scale = s_ref[group, pl.ds(i, 1), cols] if per_block else None
            return acc + block_product(x, w, scale, fp8_activations=fp8_activations and per_block)

        acc = lax.fori_loop(0, x_ref.shape[1] // chunk, step, jnp.zeros((block_m, block_n), jnp.float32))
        if s_ref is not None and not per_block:
            acc = acc * s_ref[group, pl.ds(0, 1), cols]
        if r_ref is not None:
            acc = acc * plgpu.load(r_ref.at[rows, pl.ds(0, 1)], mask=in_group, other=1)
        plgpu.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=out_mask)


@functools.partial(jax.jit, static_argnames=("block", "fp8_activations", "interpret"))
def grouped_matmul(xs: jax.Array, values: jax.Array, scale: jax.Array | None, sizes: jax.Array, *,
                   block: int | None = None, fp8_activations: bool = False, interpret: bool = False) -> jax.Array:
    """xs [n, K], its rows grouped by expert (sizes [X] rows each, in expert order; rows past sum(sizes) belong
    to none), times each group's expert of values [X, K, N] (scale [X, 1, N] per channel, [X, K / block, N]
    in blocks of `block` rows, or None) -> [n, N] in xs's dtype, rows past the groups 0, as `lax.ragged_dot`.
    fp8_activations (fp8 values with scales): the rows quantized to e4m3 per row (and block, block-wise), fp8
    dots."""
    n, k = xs.shape
    experts, _, cols = values.shape
    per_block = scale is not None and scale.shape[1] > 1
    if not fits(k, cols, block if per_block else None) or values.shape[1] != k:
        raise ValueError(f"grouped_matmul takes experts [X, K, N] with K a multiple of 16 (of blocks of a power of "
                         f"two >= 16 rows when block-wise) and N a multiple of 16; got {values.shape} for rows "
                         f"[{n}, {k}]" + (f" in blocks of {block}" if per_block else ""))
    if scale is not None and scale.shape != (experts, k // block if per_block else 1, cols):
        raise ValueError(f"scale {scale.shape} for experts {values.shape} in blocks of {block}")
    if fp8_activations and (values.dtype != jnp.float8_e4m3fn or scale is None):
        raise ValueError(f"fp8_activations needs float8_e4m3fn values with scales, not {values.dtype}"
                         + ("" if scale is not None else " unscaled"))
    block_m = min(64, max(16, pl.next_power_of_2(pl.cdiv(n, experts))))
    block_n = tile(cols, 128)
    chunk = block if per_block else tile(k, 64)
    num_tiles = pl.cdiv(n, block_m) + experts
    kernel = functools.partial(_kernel, experts=experts, block_m=block_m, block_n=block_n, chunk=chunk,
                               per_block=per_block, fp8_activations=fp8_activations)
    operands = [xs, values, *(() if scale is None else (scale,))]
    if fp8_activations and not per_block:   # per row over all of K: the rows quantized once, here
        xq, row_scale = quantize_rows(xs)
        operands = [xq, *operands[1:], row_scale]
    return pl.pallas_call(   # a tile's rows start anywhere: its loads and stores are masked to its group
        kernel,
        grid=(num_tiles, cols // block_n),
        out_shape=jax.ShapeDtypeStruct((n, cols), xs.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="grouped_matmul",
    )(_tile_map(sizes, n, block_m, num_tiles), *operands)
