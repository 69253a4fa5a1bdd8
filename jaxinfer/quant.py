"""Quantized weights as a type: a `QuantArray` (1-byte values plus float32 scales) goes wherever the model
passes a weight, and `matmul` takes either kind, so models, tp, ep, pp and sp are the same code.

A matmul weight is laid out [*lead, *contract, *out]: leading stacking axes (layers, experts), then the
axes the matmul contracts (the input features), then its output axes. Its scale is [*lead, blocks, *out]:
one per output column for each block of `block` rows of the flattened contraction (blocks == 1, block ==
K: per output channel, what `quantize` makes; smaller blocks: the block-wise scales of DeepSeek-style FP8
checkpoints, K need not be a multiple of the block). Both carry the weight's logical axes, the scale with
None for its blocks axis, so the rules table shards them alike (`scale_axes`).

Symmetric, no zero point: int8 values in [-127, 127] times scale = amax / 127; fp8 (float8_e4m3fn) values
in [-448, 448] times scale = amax / 448. Quantizing costs at most half a step per element: for int8
|w - q * s| <= s / 2 (s / 2 = amax / 254 of its column), for e4m3 the relative error of a normal number
is at most 2^-4 and the absolute error below 2^-6 * s at most 2^-10 * s (`max_error`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

QTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
QMAX = {"int8": 127.0, "fp8": 448.0}


def qtype_name(dtype) -> str:
    """"int8" or "fp8" for a values dtype."""
    for name, d in QTYPES.items():
        if jnp.dtype(dtype) == d:
            return name
    raise ValueError(f"{dtype} is not a quantized dtype ({', '.join(map(str, QTYPES.values()))})")


@struct.dataclass
class QuantArray:
    """values [*lead, *contract, *out] (int8 or float8_e4m3fn) and scale [*lead, blocks, *out] (float32);
    `out` is the number of output axes, `block` the contraction rows per scale, `axes` the logical axes of
    the values' contraction and output axes (what a kernel run per shard needs to know)."""

    values: jax.Array
    scale: jax.Array
    out: int = struct.field(pytree_node=False)
    block: int = struct.field(pytree_node=False)
    axes: tuple = struct.field(pytree_node=False, default=())

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def contract(self) -> int:
        """How many axes the matmul contracts (scanning off leading axes leaves this unchanged)."""
        return len(self.values.shape) - len(self.scale.shape) + 1

    @property
    def lead(self) -> int:
        return self.ndim - self.contract - self.out

    def shard_rows(self, first: jax.Array | int) -> QuantArray:
        """This device's shard of a weight whose contraction is split over devices: its values hold the
        contraction's rows [first, first + K), `first` a multiple of `block` (traced: an axis index times K),
        its scale still every block's -> the scale cut to its own blocks (per channel: as it is)."""
        a = self.lead
        if self.scale.shape[a] == 1:
            return self
        k = math.prod(self.values.shape[a: a + self.contract])
        return self.replace(scale=jax.lax.dynamic_slice_in_dim(self.scale, first // self.block, -(-k // self.block),
                                                                axis=a))

    def full_scale(self) -> jax.Array:
        """The scale of every contraction row: [*lead, K, *out] (blocks repeated, cut to K)."""
        a, k = self.lead, math.prod(self.values.shape[self.lead: self.lead + self.contract])
        if self.scale.shape[a] == 1:
            return self.scale
        return jax.lax.slice_in_dim(jnp.repeat(self.scale, self.block, axis=a), 0, k, axis=a)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """values * scale, computed in float32 and rounded once to `dtype`."""
        a, shape = self.lead, self.values.shape
        flat = self.values.reshape(*shape[:a], -1, *shape[a + self.contract:])
        return (flat.astype(jnp.float32) * self.full_scale()).astype(dtype).reshape(shape)


def scale_axes(axes: tuple, contract: int, out: int) -> tuple:
    """A weight's logical axes -> its scale's: the contraction axes become one unsharded blocks axis."""
    lead = len(axes) - contract - out
    return (*axes[:lead], None, *axes[lead + contract:])


def axes_of(w, axes: tuple):
    """The shard_map spec of a weight that may be quantized: `axes` for a plain array, a QuantArray of the
    values' and the scale's axes for a quantized one."""
    if not isinstance(w, QuantArray):
        return axes
    return w.replace(values=axes, scale=scale_axes(axes, w.contract, w.out))


def quantize(w: jax.Array, qtype: str, *, contract: int, out: int, axes: tuple = ()) -> QuantArray:
    """w [*lead, *contract, *out] -> per-output-channel symmetric QuantArray (traceable; under jit the
    column maxima over a sharded contraction are one small all-reduce)."""
    a = w.ndim - contract - out
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=tuple(range(a, a + contract)), keepdims=True)
    scale = jnp.where(amax > 0, amax / QMAX[qtype], 1.0)
    q = jnp.clip(w32 / scale, -QMAX[qtype], QMAX[qtype])
    values = jnp.round(q).astype(jnp.int8) if qtype == "int8" else q.astype(jnp.float8_e4m3fn)
    scale = scale.reshape(*w.shape[:a], 1, *w.shape[a + contract:])
    return QuantArray(values, scale, out=out, block=math.prod(w.shape[a: a + contract]), axes=axes)


def max_error(w: jax.Array, q: QuantArray) -> jax.Array:
    """The largest |w - dequantize(q)| quantization allows for each element of w (see the module docstring)."""
    a, c, s = q.lead, q.contract, q.full_scale()
    rows = q.shape[a: a + c] if s.shape[a] > 1 else (1,) * c
    s = s.reshape(*s.shape[:a], *rows, *s.shape[a + 1:])
    if q.values.dtype == jnp.int8:
        return s / 2
    return jnp.maximum(jnp.abs(w) * 2.0 ** -4, s * 2.0 ** -10)


def matmul(x: jax.Array, w: jax.Array | QuantArray, contract: int = 1, out_dtype=None) -> jax.Array:
    """x [..., *k] times w [*k, *out] -> [..., *out] in x's dtype (a plain w: in `out_dtype` where given, its
    sums float32 either way); w a plain array or a QuantArray.

    A QuantArray's values go into the product converted to x's dtype (exact: every int8 and e4m3 value is a
    bfloat16), the product accumulated in float32 and then scaled: XLA:GPU fuses that conversion into the GEMM,
    which then reads one byte per weight, where a weight dequantized first is written out in full precision and
    read back on every step (the program compiled for an H100 did so for every weight,
    `python -m jaxinfer.bench.gpu_compile`). One scale per output channel scales the product's columns;
    block-wise scales vary along the contraction, so each block of it is a product of its own, scaled and
    summed (`by_blocks`), while those float32 products are fewer bytes than the weight in x's dtype: for a few
    rows; more rows dequantize the weight first. XLA:CPU runs the C++ kernel instead (see
    jaxinfer.device.layers.StepContext.matmul).

    One contraction axis: a 2-D product with w flattened to [K, out] (a free reshape); as an einsum over
    w's several output axes, XLA:CPU copied w on every step. Several (the attention output [H, D, E]):
    contracted in the weight's own order, which XLA:CPU reads in place."""
    if not isinstance(w, QuantArray):
        return _product(x, w, contract, out_dtype)
    if w.scale.shape[w.lead] == 1:
        y = _product(x, w.values.astype(x.dtype), w.contract, jnp.float32)
        return (y * w.scale.reshape(w.shape[w.contract:])).astype(x.dtype)
    if not by_blocks(x, w):
        return _product(x, w.dequantize(x.dtype), w.contract)
    rows, values = _blocks(x, w)
    y = _block_products(rows, values.astype(x.dtype), w.scale.reshape(rows.shape[1], 1, -1))
    return _unrows(y, x, w)


def by_blocks(x: jax.Array, w: QuantArray) -> bool:
    """Whether x times a block-wise weight goes block by block: for T rows (at least two) and a [K, N] weight in
    G blocks, a float32 product [G, T, N] is written and read back (and the values padded to G whole blocks
    where the last is partial, a 1-byte copy), against the weight dequantized to x's dtype [K, N]: per block
    for fewer than about block / 2 rows of a 2-byte dtype (block / 4 with the copy)."""
    rows = max(2, math.prod(x.shape[: x.ndim - w.contract]))
    blocks, k = w.scale.shape[w.lead], math.prod(w.shape[w.lead: w.lead + w.contract])
    copy = w.values.dtype.itemsize * k if blocks * w.block != k else 0
    return 4 * rows * blocks + copy < x.dtype.itemsize * k


def _blocks(x: jax.Array, w: QuantArray) -> tuple[jax.Array, jax.Array]:
    """x as rows [T, blocks, block] (at least two rows: a one-row product is a matrix-vector product, which
    XLA:GPU turns into a multiply and a reduction over the whole weight, or lays out row-major where the fp8
    GEMM reads its weight contraction-minor) and the values as [blocks, block, N]; a partial last block reads
    zeros."""
    c = w.contract
    k, n, blocks = math.prod(w.shape[:c]), math.prod(w.shape[c:]), w.scale.shape[0]
    rows = x.reshape(-1, k)
    pad = blocks * w.block - k
    rows = jnp.pad(rows, ((0, max(0, 2 - rows.shape[0])), (0, pad))).reshape(-1, blocks, w.block)
    return rows, jnp.pad(w.values.reshape(k, n), ((0, pad), (0, 0))).reshape(blocks, w.block, n)


def _block_products(rows: jax.Array, values: jax.Array, scale: jax.Array) -> jax.Array:
    """rows [T, blocks, block] times values [blocks, block, N], one product per block accumulated in float32,
    each times its scale [blocks, T or 1, N], summed over the blocks -> [T, N] float32."""
    y = jax.lax.dot_general(rows, values, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.float32)
    return (y * scale).sum(0)


def _unrows(y: jax.Array, x: jax.Array, w: QuantArray) -> jax.Array:
    """[T (padded), N] float32 -> [..., *out] in x's dtype."""
    t = math.prod(x.shape[: x.ndim - w.contract])
    return y[:t].astype(x.dtype).reshape(*x.shape[: x.ndim - w.contract], *w.shape[w.contract:])


def _product(x: jax.Array, w: jax.Array, contract: int, out_dtype=None) -> jax.Array:
    if contract == 1:
        y = jnp.einsum("...e,eo->...o", x, w.reshape(w.shape[0], -1), preferred_element_type=out_dtype)
        return y.reshape(*x.shape[:-1], *w.shape[1:])
    dims = (tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract)))
    return jax.lax.dot_general(x, w, (dims, ((), ())), preferred_element_type=out_dtype)


def fp8_matmul(x: jax.Array, w: QuantArray) -> jax.Array:
    """x [..., *k] times an fp8 weight as fp8 GEMMs (Hopper's tensor cores; XLA rewrites the float8 dot with
    its scales into a cuBLASLt or Triton fp8 matmul): the activations quantized on the fly to float8_e4m3fn
    with one scale per token and block of the weight's contraction blocks (dynamic per-token activations, the
    scheme compressed-tensors and DeepSeek's FP8 checkpoints declare), each block's products accumulated in
    float32 and scaled by both scales. -> [..., *out] in x's dtype. A block-wise weight is multiplied so
    while its float32 products per block are the fewer bytes (`by_blocks`); for more rows it is dequantized
    and multiplied in x's dtype (`matmul`)."""
    if w.lead:
        raise ValueError(f"fp8_matmul takes one weight [*contract, *out], not a stack of {w.shape[:w.lead]}")
    blocks = w.scale.shape[0]
    if blocks > 1 and not by_blocks(x, w):
        return matmul(x, w, w.contract)
    rows, values = _blocks(x, w)
    xb = rows.astype(jnp.float32)
    xs = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) / QMAX["fp8"]
    xs = jnp.where(xs > 0, xs, 1.0)
    xq = (xb / xs).astype(jnp.float8_e4m3fn)                    # [T, blocks, block]
    scale = w.scale.reshape(blocks, 1, -1)
    if blocks == 1:   # per-channel: one plain fp8 GEMM
        y = jax.lax.dot_general(xq[:, 0], values[0], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        y = y * xs[:, 0] * scale[0]
    else:             # block-wise: one GEMM per contraction block, batched, then scaled and summed
        y = _block_products(xq, values, xs.transpose(1, 0, 2) * scale)
    return _unrows(y, x, w)


def weight_quantization(weights) -> str | None:
    """What a weights pytree holds quantized: "int8", "fp8" (both: "fp8+int8"), or None."""
    leaves = jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantArray))
    return "+".join(sorted({qtype_name(x.values.dtype) for x in leaves
                            if isinstance(x, QuantArray) and x.values.dtype.itemsize == 1})) or None
