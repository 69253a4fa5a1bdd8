"""The model's matmuls on each backend: where a quantized weight (jaxinfer.quant.QuantArray) runs.

- "cpu": the C++ dequantizing matmul (jaxinfer.device.quant_matmul_cpu), one call per device inside a
  shard_map: XLA:CPU would otherwise write a dequantized copy of every weight on every step, so int8 would
  read more bytes than float32, not fewer. A weight whose contraction is split (the row-parallel o and
  down under tp) ends in the same all-reduce over tp that the compiler emits for a plain one. A 16-bit
  model's matmul weights, the LM head's included, go there too, held with unit scales (`kernel_weights`):
  XLA:CPU's bfloat16 and float16 dots have no vector path.
- GPUs, block-wise weights (scales per block of the contraction): the Pallas kernel
  (jaxinfer.pallas_kernels.block_matmul), one call per device inside a shard_map like the CPU's, which scales
  each block's product as it accumulates (XLA writes every block's float32 product and reads it back); fp8
  ones with fp8 activations where the GPU has fp8 tensor cores. Shapes it does not tile (a block that is not
  a power of two, a partial last block) take the paths below.
- GPUs with fp8 tensor cores (compute capability 9.0, Hopper, and later), whatever the attention backend: fp8
  weights as fp8 GEMMs (jaxinfer.quant.fp8_matmul), their values stored contraction-minor for them
  (`gemm_layouts`).
- GPUs without: fp8 weights dequantized, then the plain matmul. Their Triton GEMMs cannot convert float8
  (XLA writes a bfloat16 copy of the weight first, so a block-wise weight's products per block would only
  add their own bytes to that copy's).
- Any other weight and device: jaxinfer.quant.matmul, whose conversion to the activations' dtype XLA:GPU
  fuses into the GEMM.
- On every backend, a block-wise weight whose contraction is split over devices at a row that is not a block
  boundary (a down projection of 11008 rows in blocks of 128 over tp=8) is dequantized first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format
from jax.experimental.layout import Layout as DeviceLayout

from jaxinfer.device import quant_matmul_cpu
from jaxinfer.pallas_kernels import block_matmul
from jaxinfer.quant import QuantArray, fp8_matmul, matmul, scale_axes
from jaxinfer.sharding import Layout

ROWS = ("batch", "seq")   # the activations' leading axes: [replicas, tokens per replica, ...]


def model_matmul(x: jax.Array, w: jax.Array | QuantArray, contract: int, layout: Layout, backend: str,
                 out_dtype=None) -> jax.Array:
    """x [R, N, *k] times w [*k, *out] -> [R, N, *out] in `out_dtype` (default x's; the logits ask for float32,
    a wider type than x's), with `backend`'s kernel where one applies.

    One row per GPU is given a second (zeros): XLA:GPU turns a matrix-vector product with a weight under 10M
    elements (`dot-strength-reduction`) into a multiply and a reduction, and wrote the whole product out
    between them (a [4096, 768] q/k/v weight's at tp=8: 201 MiB a step of an 8B model); two rows are a GEMM."""
    if layout.platform == "gpu" and _rows_per_device(x, layout) == 1:
        n = x.shape[1]
        wide = jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2))
        return model_matmul(wide, w, contract, layout, backend, out_dtype)[:, :n]
    if not isinstance(w, QuantArray):
        return matmul(x, w, contract, out_dtype)
    if out_dtype is not None:   # a QuantArray's product comes in x's dtype, from float32 sums
        return model_matmul(x.astype(out_dtype), w, contract, layout, backend)
    if w.axes:
        if not _blocks_align(w, layout):
            return matmul(x, w.dequantize(x.dtype), contract)
        if backend == "cpu" and quant_matmul_cpu.available():
            return _per_device(x, w, layout, quant_matmul_cpu.quantized_matmul)
        fp8 = w.values.dtype == jnp.float8_e4m3fn
        if (layout.platform == "gpu" and w.scale.shape[0] > 1 and (has_fp8_gemm(layout) or not fp8)
                and block_matmul.fits(*_device_shape(w, layout), w.block)):
            return _per_device(x, w, layout, functools.partial(block_matmul.block_matmul, fp8_activations=fp8))
        if fp8:
            if has_fp8_gemm(layout):
                return fp8_matmul(x, w)
            if layout.platform == "gpu":
                return matmul(x, w.dequantize(x.dtype), contract)
    return matmul(x, w, contract)


def kernel_weights(weights, specs, layout: Layout, backend: str):
    """On the "cpu" backend, each 16-bit matmul weight (bfloat16, float16; a model marks them with
    ParamSpec.contract) held as a QuantArray of its own values with unit scales, one per output channel, so the
    C++ matmul reads it as stored: XLA:CPU's 16-bit dots have no vector path (about 1 GB/s, a twentieth of a
    float32 dot's speed at one row, `python -m jaxinfer.device.quant_matmul_cpu`). Nothing is copied; the
    scales add 4 bytes per output column. Takes the arrays or their jax.ShapeDtypeStructs, and the spec tree
    they were made from."""
    if not (layout.platform == "cpu" and backend == "cpu" and quant_matmul_cpu.available()):
        return weights

    def hold(w, spec):
        if isinstance(w, QuantArray) or not getattr(spec, "contract", 0) or jnp.dtype(w.dtype).itemsize != 2:
            return w
        lead, contract = spec.stack_depth, spec.contract
        shape = (*w.shape[:lead], 1, *w.shape[lead + contract:])
        axes = scale_axes(spec.axes, contract, len(w.shape) - lead - contract)
        sharding = layout.sharding(axes)
        scale = (jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding) if isinstance(w, jax.ShapeDtypeStruct)
                 else jax.device_put(np.ones(shape, np.float32), sharding))
        return QuantArray(w, scale, out=len(axes) - lead - 1, block=math.prod(w.shape[lead: lead + contract]),
                          axes=spec.axes[lead:])

    return jax.tree.map(hold, weights, specs, is_leaf=lambda x: isinstance(x, QuantArray))


def has_fp8_gemm(layout: Layout) -> bool:
    """Whether the mesh's GPUs multiply float8 on their tensor cores (compute capability 9.0 and later)."""
    device = layout.mesh.devices.flat[0]
    capability = getattr(device, "compute_capability", None)
    return layout.platform == "gpu" and capability is not None and float(capability) >= 9.0


def gemm_layouts(weights, layout: Layout):
    """The weights laid out in device memory as the fp8 GEMM reads them: where the devices have one, each fp8
    weight with one scale per output channel gets its values stored with the contraction axes minor
    (`contraction_minor`). Hopper's fp8 GEMMs take
    their second operand contraction-minor only, so for a [K, N] weight stored row-major XLA inserts a
    transpose before every GEMM: the whole weight read and written once more per step, three bytes moved per
    weight where bfloat16 moves two. Only the physical layout changes (shape, sharding and values are the
    same), and the step programs compile for the layout their arguments have. Takes the arrays or their
    jax.ShapeDtypeStructs (the engine compiles against those while the weights load); each array relaid is
    freed as soon as its copy exists, so loading never holds two copies of the weights.
    Block-wise weights stay row-major, as the Pallas kernel reads them; so do the experts of an MoE layer (two
    leading axes, layers and experts, where a dense weight has its layers only): their grouped matmul reads
    them row-major (jaxinfer.device.moe)."""
    if not has_fp8_gemm(layout):
        return weights

    def relayout(w):
        if not (isinstance(w, QuantArray) and w.values.dtype == jnp.float8_e4m3fn and w.scale.shape[w.lead] == 1
                and w.lead == 1):
            return w
        target = contraction_minor(w)
        if isinstance(w.values, jax.ShapeDtypeStruct):
            return w.replace(values=jax.ShapeDtypeStruct(w.shape, w.values.dtype, sharding=target))
        values = jax.device_put(w.values, target)
        if values is not w.values:
            w.values.delete()
        return w.replace(values=values)

    return jax.tree.map(relayout, weights, is_leaf=lambda x: isinstance(x, QuantArray))


def contraction_minor(w: QuantArray) -> Format:
    """Where w's values go for the fp8 GEMM: their sharding, axes ordered [*lead, *out, *contract] from major
    to minor."""
    a, c = w.lead, w.contract
    order = (*range(a), *range(a + c, w.ndim), *range(a, a + c))
    return Format(DeviceLayout(major_to_minor=order), w.values.sharding)


def _rows_per_device(x: jax.Array, layout: Layout) -> int:
    return x.shape[0] * x.shape[1] // _shards(ROWS, layout)


def _device_shape(w: QuantArray, layout: Layout) -> tuple[int, int]:
    """(K, N) of one device's shard of w."""
    c = w.contract
    k = math.prod(w.shape[:c]) // _shards(w.axes[:c], layout)
    return k, math.prod(w.shape[c:]) // _shards(w.axes[c:], layout)


def _shards(axes: tuple, layout: Layout) -> int:
    return math.prod(layout.axis_size(a) for a in axes if a is not None)


def _blocks_align(w: QuantArray, layout: Layout) -> bool:
    """Whether a device's rows of a split contraction start where a block of scales starts: the kernels and
    the products per block take each device's blocks whole (otherwise XLA would move the weight's rows between
    devices to cut them into blocks: it is dequantized first instead)."""
    if w.scale.shape[0] == 1:
        return True
    shards = _shards(w.axes[: w.contract], layout)
    k = math.prod(w.shape[: w.contract])
    return shards == 1 or (k // shards) % w.block == 0


def _per_device(x: jax.Array, w: QuantArray, layout: Layout, kernel: Callable) -> jax.Array:
    """x [R, N, *k] times w by `kernel(x [T, K], values [K, N], scale [blocks, N], block=) -> [T, N]` on each
    device's shards, inside a shard_map; a split contraction ends in an all-reduce over its mesh axes."""
    c = w.contract
    k_axes, out_axes = w.axes[:c], w.axes[c:]
    split = tuple(m for a in k_axes for m in layout.mesh_axes(a))   # mesh axes the contraction is split over

    def local(x, values, scale):
        rows, k_shape, out_shape = x.shape[:2], values.shape[:c], values.shape[c:]
        k, n = math.prod(k_shape), math.prod(out_shape)
        if split:   # this device's blocks of a split contraction
            scale = w.replace(values=values, scale=scale).shard_rows(jax.lax.axis_index(split) * k).scale
        y = kernel(x.reshape(-1, k), values.reshape(k, n), scale.reshape(-1, n), block=w.block)
        y = y.reshape(*rows, *out_shape)
        return jax.lax.psum(y, split) if split else y

    scale_axes = (None, *out_axes)
    return layout.shard_map(local, in_axes=((*ROWS, *k_axes), w.axes, scale_axes), out_axes=(*ROWS, *out_axes),
                            check_vma=False)(x, w.values, w.scale)   # a pallas_call's output has no vma type
