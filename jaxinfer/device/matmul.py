"""The model's matmuls on each backend: where a quantized weight (jaxinfer.quant.QuantArray) runs.

- "cpu": the C++ dequantizing matmul (jaxinfer.device.quant_matmul_cpu), one call per device inside a
  shard_map: XLA:CPU would otherwise write a dequantized copy of every weight on every step, so int8 would
  read more bytes than float32, not fewer. A weight whose contraction is split (the row-parallel o and
  down under tp) ends in the same all-reduce over tp that the compiler emits for a plain one.
- GPUs with fp8 tensor cores (compute capability 9.0, Hopper, and later), whatever the attention backend: fp8
  weights as one fp8 GEMM (jaxinfer.quant.fp8_matmul), their values stored contraction-minor for it
  (`gemm_layouts`).
- Any other weight and device: dequantize, then the plain matmul (jaxinfer.quant.matmul), which XLA fuses on
  GPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format
from jax.experimental.layout import Layout as DeviceLayout

from jaxinfer.device import quant_matmul_cpu
from jaxinfer.quant import QuantArray, fp8_matmul, matmul
from jaxinfer.sharding import Layout

ROWS = ("batch", "seq")   # the activations' leading axes: [replicas, tokens per replica, ...]


def model_matmul(x: jax.Array, w: jax.Array | QuantArray, contract: int, layout: Layout, backend: str) -> jax.Array:
    """x [R, N, *k] times w [*k, *out] -> [R, N, *out] in x's dtype, with `backend`'s kernel where one applies."""
    if isinstance(w, QuantArray) and w.axes:
        if backend == "cpu" and quant_matmul_cpu.available() and _cpu_takes(w, layout):
            return _cpu_matmul(x, w, layout)
        if w.values.dtype == jnp.float8_e4m3fn and has_fp8_gemm(layout):
            return fp8_matmul(x, w)
    return matmul(x, w, contract)


def has_fp8_gemm(layout: Layout) -> bool:
    """Whether the mesh's GPUs multiply float8 on their tensor cores (compute capability 9.0 and later)."""
    device = layout.mesh.devices.flat[0]
    capability = getattr(device, "compute_capability", None)
    return layout.platform == "gpu" and capability is not None and float(capability) >= 9.0


def gemm_layouts(weights, layout: Layout):
    """The weights laid out in device memory as the fp8 GEMM reads them: where the devices have one, each fp8
    weight with one scale per output channel gets its values stored with the contraction axes minor. cuBLASLt's
    fp8 GEMM takes its second operand column-major only, so for a [K, N] weight stored row-major XLA's GEMM
    rewriter inserts a transpose before every GEMM: the whole weight read and written once more per step,
    three bytes moved per weight where bfloat16 moves two. Only the physical layout changes (shape, sharding
    and values are the same), and the step programs compile for the layout their arguments have. Takes the
    arrays or their jax.ShapeDtypeStructs (the engine compiles against those while the weights load); each
    array relaid is freed as soon as its copy exists, so loading never holds two copies of the weights.
    Block-wise scales are left as they are: their GEMM is batched over the contraction's blocks, which a
    layout of the [K, N] weight cannot make major. So are the experts of an MoE layer (two leading axes,
    layers and experts, where a dense weight has its layers only): their grouped matmul reads them row-major
    (jaxinfer.device.moe)."""
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


def _cpu_takes(w: QuantArray, layout: Layout) -> bool:
    """Block-wise scales need the blocks of a split contraction to start where a device's rows start."""
    if w.scale.shape[0] == 1:
        return True
    shards = math.prod(layout.axis_size(a) for a in w.axes[: w.contract] if a is not None)
    k = math.prod(w.shape[: w.contract])
    return shards == 1 or (k // shards) % w.block == 0


def _cpu_matmul(x: jax.Array, w: QuantArray, layout: Layout) -> jax.Array:
    c = w.contract
    k_axes, out_axes = w.axes[:c], w.axes[c:]
    split = tuple(m for a in k_axes for m in layout.mesh_axes(a))   # mesh axes the contraction is split over

    def local(x, values, scale):
        rows, k_shape, out_shape = x.shape[:2], values.shape[:c], values.shape[c:]
        k, n = math.prod(k_shape), math.prod(out_shape)
        if scale.shape[0] > 1 and split:   # this device's blocks of a split contraction
            first = jax.lax.axis_index(split) * (k // w.block)
            scale = jax.lax.dynamic_slice_in_dim(scale, first, -(-k // w.block), axis=0)
        y = quant_matmul_cpu.quantized_matmul(x.reshape(-1, k), values.reshape(k, n), scale.reshape(-1, n),
                                              block=w.block)
        y = y.reshape(*rows, *out_shape)
        return jax.lax.psum(y, split) if split else y

    scale_axes = (None, *out_axes)
    return layout.shard_map(local, in_axes=((*ROWS, *k_axes), w.axes, scale_axes),
                            out_axes=(*ROWS, *out_axes))(x, w.values, w.scale)
