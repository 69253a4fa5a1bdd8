"""The "cpu" attention backend: ragged paged attention as a C++ kernel XLA:CPU calls through its FFI.

XLA:CPU runs the jnp reference over 16-token pages as dozens of small gathers and matmuls per layer, each
at a fixed cost, so a decode step's attention cost far more than its K/V reads (and its kernels a third
of a step's compile time). The kernel (paged_attention_cpu.cc) walks each sequence's pages once per
block of its query tokens and kv head, on XLA's intra-op threads when the step is large enough. The engine
calls it as `rope_write_attend`: RoPE, the K/V writes and attention in one call per layer, the pools
updated in place.

It is compiled on first use (jaxinfer/device/native.py: the host's C++ compiler, kept in
$JAXINFER_CACHE/kernels): a pip install needs no compiler, and where none works the engine keeps the jnp
reference (`available()` says why).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from jaxinfer.device import native
from jaxinfer.pallas_kernels.block_attention import check_shapes
from jaxinfer.pallas_kernels.kv_quant import is_quantized
from jaxinfer.pallas_kernels.rope_cache import cos_sin

SOURCE = Path(__file__).with_name("paged_attention_cpu.cc")
TARGETS = {"jaxinfer_ragged_paged_attention": "RaggedPagedAttention", "jaxinfer_rope_write_attend": "RopeWriteAttend",
           # int8 / float8_e4m3fn pages with their bf16 scales (pallas_kernels/kv_quant.py)
           "jaxinfer_ragged_paged_attention_quantized": "RaggedPagedAttentionQuantized",
           "jaxinfer_rope_write_attend_quantized": "RopeWriteAttendQuantized",
           "jaxinfer_paged_attention_partial": "PagedAttentionPartial",
           "jaxinfer_paged_attention_partial_quantized": "PagedAttentionPartialQuantized",
           "jaxinfer_block_attention_partial": "BlockAttentionPartial"}
FLAGS = native.FLAGS
DTYPES = ("float32", "bfloat16", "float16")

BuildError = native.BuildError


def library_path() -> Path:
    """Where the built kernel lives: one file per source, compiler, jaxlib and host CPU."""
    return native.library_path(SOURCE, FLAGS)


def build() -> Path:
    """Compiles the kernel unless this machine already has it (atomically: concurrent builds are harmless)."""
    return native.build(SOURCE, FLAGS)


def _register() -> str | None:
    """Builds, loads and registers the kernel once per process; the reason it cannot, or None."""
    return native.register(SOURCE, TARGETS, FLAGS)


def available() -> bool:
    return _register() is None


def unavailable_reason() -> str | None:
    return _register()


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array,
                           page_table: jax.Array, seq_lens: jax.Array, query_start: jax.Array,
                           num_seqs: jax.Array, *, sm_scale: float, k_scales: jax.Array | None = None,
                           v_scales: jax.Array | None = None) -> jax.Array:
    """The contract of `ragged_paged_attention_reference` (without return_lse), on one CPU device; quantized
    pages (int8, float8_e4m3fn) with their scales."""
    scales = _scales(k_pages, k_scales, v_scales)
    if reason := _register():
        raise BuildError(reason)
    target = "jaxinfer_ragged_paged_attention" + ("_quantized" if scales else "")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pages, v_pages, *scales, *map(_i32, (layer, page_table, seq_lens, query_start, num_seqs)),
                sm_scale=np.float32(sm_scale))


def paged_attention_partial(q: jax.Array, query_start: jax.Array, num_seqs: jax.Array, kv_limit: jax.Array,
                            k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array, page_table: jax.Array, *,
                            sm_scale: float, page_stride: int = 1, page_offset: jax.Array | int = 0,
                            k_scales: jax.Array | None = None,
                            v_scales: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The contract of the reference's `paged_attention_partial` on one CPU device: float32 (out [N, H, D],
    lse [N, H]) of each token over the keys of its sequence's table entries (entry j: page j * page_stride +
    page_offset) at positions below kv_limit; what sequence parallel's ranks merge."""
    scales = _scales(k_pages, k_scales, v_scales)
    if reason := _register():
        raise BuildError(reason)
    n, h, d = q.shape
    target = "jaxinfer_paged_attention_partial" + ("_quantized" if scales else "")
    call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct((n, h, d), np.float32),
                                     jax.ShapeDtypeStruct((n, h), np.float32)))
    return call(q, k_pages, v_pages, *scales, *map(_i32, (layer, page_table, query_start, num_seqs, kv_limit,
                                                          page_offset)),
                page_stride=np.int64(page_stride), sm_scale=np.float32(sm_scale))


def block_attention(q: jax.Array, q_pos: jax.Array, q_seq: jax.Array, k: jax.Array, v: jax.Array, k_pos: jax.Array,
                    k_seq: jax.Array, *, sm_scale: float) -> tuple[jax.Array, jax.Array]:
    """The contract of `block_attention_reference` (pallas_kernels/block_attention.py) on one CPU device: float32
    (out [N, H, D], lse [N, H]) of queries over a block of keys of the same step; what a rank of ring attention
    does with each block passing by."""
    if reason := _register():
        raise BuildError(reason)
    check_shapes(q, q_pos, q_seq, k, v, k_pos, k_seq)
    n, h, d = q.shape
    call = jax.ffi.ffi_call("jaxinfer_block_attention_partial", (jax.ShapeDtypeStruct((n, h, d), np.float32),
                                                                 jax.ShapeDtypeStruct((n, h), np.float32)))
    kt, vt = (x.transpose(1, 0, 2) for x in (k, v))   # [KV, M, D]: a kv head's keys contiguous, as tiles read them
    return call(q, kt, vt, *map(_i32, (q_pos, q_seq, k_pos, k_seq)), sm_scale=np.float32(sm_scale))


def rope_write_attend(q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                      layer: jax.Array, positions: jax.Array, slots: jax.Array, inv_freq: jax.Array,
                      page_table: jax.Array, seq_lens: jax.Array, query_start: jax.Array, num_seqs: jax.Array, *,
                      sm_scale: float, k_scales: jax.Array | None = None,
                      v_scales: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """A layer's attention in one call on one CPU device: `rope_and_write_reference` (q, k unrotated), then
    `ragged_paged_attention_reference` over the written pools -> (out, k_pages, v_pages), and the scales after
    them for quantized pages (k and v quantized as they are written). The pools (and scales) are aliased to the
    results, so a pool the caller no longer holds (donated, or a loop's carry) is written in place."""
    pools = (k_pages, v_pages, *_scales(k_pages, k_scales, v_scales))
    if reason := _register():
        raise BuildError(reason)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools))
    target = "jaxinfer_rope_write_attend" + ("_quantized" if len(pools) == 4 else "")
    call = jax.ffi.ffi_call(target, results, input_output_aliases={3 + i: 1 + i for i in range(len(pools))})
    cos, sin = cos_sin(positions, inv_freq)   # XLA's cos and sin, vectorized (the reference's own)
    return call(q, k, v, *pools, _i32(layer), _i32(slots), cos, sin,
                *map(_i32, (page_table, seq_lens, query_start, num_seqs)), sm_scale=np.float32(sm_scale))


def _scales(k_pages: jax.Array, k_scales: jax.Array | None, v_scales: jax.Array | None) -> tuple[jax.Array, ...]:
    """The scales operands: both for quantized pages, none otherwise; a mismatch is refused before any call."""
    if (k_scales is None) != (v_scales is None) or (k_scales is not None) != is_quantized(k_pages.dtype):
        raise ValueError(f"pages of {k_pages.dtype} {'need' if is_quantized(k_pages.dtype) else 'take no'} "
                         f"k_scales and v_scales")
    return () if k_scales is None else (k_scales, v_scales)


def _i32(x) -> jax.Array:
    return jax.numpy.asarray(x, dtype=np.int32)
