"""The paged KV cache on device: one pool of pages per layer, addressed through page tables.

Layout [layers, kv_heads, pages, page_size, head_dim]: a page of one KV head is one contiguous
[page_size, head_dim] tile (what a GPU kernel loads), KV heads shard over tp, and the pages axis over
dp, so each data-parallel replica owns its own slice of the pool and indexes it with local page ids.
The host side (free pages and their placement, reference counts, prefix cache) is jaxinfer/engine/page_pool.py.

Quantized pages (EngineConfig.kv_cache_dtype "int8" or "fp8" = float8_e4m3fn): the pools hold int8 or
e4m3fn elements, and two more arrays, `k_scale` and `v_scale` [layers, kv_heads, pages, page_size, 1] in
bfloat16, hold one scale per written vector (one token's K or V of one KV head). Same rank and axes as the
pools, so they shard, donate, scan and page exactly like them (POOL_AXES), and a kernel loading a page's
[page_size, head_dim] tile loads its [page_size, 1] scales beside it. Why per token and KV head rather than
per page and head: a vector is quantized once, when it is written, from itself alone, so a write never reads
or rewrites what is already in the page (a per-page scale would have to re-quantize the page whenever a later
token, of a decode step or the next prefill chunk, raised its maximum, and its rounding would then depend on
how the prompt was chunked); and each vector gets the finest step its own values allow, which matters for K,
whose magnitudes differ much from token to token. It costs 2 bytes per vector: head_dim 64 stores 66 bytes
instead of bfloat16's 128, 1.94x the tokens in the same memory (page_bytes counts the scales). The rounding
itself, the same in every backend, is pallas_kernels/kv_quant.py: quantized where K/V are written
(rope_and_write, the C++ kernel's write, the ring's writes), dequantized to the model's dtype where pages
are read, tile by tile inside each attention kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.config import EngineConfig
from jaxinfer.pallas_kernels.kv_quant import KV_DTYPES, SCALE_DTYPE
from jaxinfer.sharding import Axes, Layout

POOL_AXES: Axes = ("layers", "kv_heads", "pages", None, "head_dim")
CPU_KV_BUDGET = 2 << 30  # bytes of KV pages per device where the device does not report its memory


def storage_dtype(kv_cache_dtype: str, dtype) -> jnp.dtype:
    """The pages' element type: the model's dtype for "auto", else int8 or float8_e4m3fn."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(dtype)
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of auto, {', '.join(KV_DTYPES)}")
    return jnp.dtype(KV_DTYPES[kv_cache_dtype])


@struct.dataclass
class PagedKVCache:
    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None   # quantized pages: bfloat16 [layers, kv_heads, pages, page_size, 1]
    v_scale: jax.Array | None = None

    @classmethod
    def zeros(cls, layers: int, kv_heads: int, pages: int, page_size: int, head_dim: int, dtype,
              layout: Layout, kv_cache_dtype: str = "auto") -> PagedKVCache:
        """A pool of zeros; with kv_cache_dtype int8 or fp8, quantized pages and their scales."""
        shape = (layers, kv_heads, pages, page_size, head_dim)
        stored = storage_dtype(kv_cache_dtype, dtype)

        def make(shape, dtype):
            return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=layout.sharding(POOL_AXES))()

        if kv_cache_dtype == "auto":
            return cls(k=make(shape, stored), v=make(shape, stored))
        scales = (*shape[:-1], 1)
        return cls(k=make(shape, stored), v=make(shape, stored), k_scale=make(scales, SCALE_DTYPE),
                   v_scale=make(scales, SCALE_DTYPE))

    @classmethod
    def shapes(cls, *args, **kwargs) -> PagedKVCache:
        """The jax.ShapeDtypeStructs (shardings included) of `zeros(*args, **kwargs)`, nothing allocated: enough
        to compile the steps that would use it."""
        return jax.eval_shape(lambda: cls.zeros(*args, **kwargs))

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def pools(self) -> tuple[jax.Array, ...]:
        """(k, v), or (k, v, k_scale, v_scale) for quantized pages: every array a write updates."""
        return (self.k, self.v, self.k_scale, self.v_scale) if self.quantized else (self.k, self.v)

    @classmethod
    def of(cls, pools: tuple[jax.Array, ...] | list[jax.Array]) -> PagedKVCache:
        """The inverse of pools()."""
        return cls(*pools)


def scale_args(pools: tuple[jax.Array, ...] | list[jax.Array]) -> dict[str, jax.Array]:
    """The kernels' keyword arguments for the scales of `pools` (PagedKVCache.pools()): none for plain pages."""
    return dict(k_scales=pools[2], v_scales=pools[3]) if len(pools) == 4 else {}


def vector_bytes(head_dim: int, dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one token's K (or V) of one KV head takes in the pool: its elements, and its scale if quantized."""
    scale = 0 if kv_cache_dtype == "auto" else jnp.dtype(SCALE_DTYPE).itemsize
    return head_dim * storage_dtype(kv_cache_dtype, dtype).itemsize + scale


def page_bytes(layers: int, kv_heads: int, page_size: int, head_dim: int, dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one page of K and V across all layers and (replicated) KV heads, quantized pages' scales
    included."""
    return 2 * layers * kv_heads * page_size * vector_bytes(head_dim, dtype, kv_cache_dtype)


def pool_pages(config: EngineConfig, device: jax.Device, weight_bytes_per_device: int, bytes_per_page_per_device: int,
               context_length: int) -> int:
    """Pages per replica: config.num_pages, else what fits in `memory_fraction` of a device's memory after
    its weights (vLLM's gpu_memory_utilization); where the device does not report its memory (CPU), enough
    for max_num_seqs full contexts within CPU_KV_BUDGET."""
    if config.num_pages is not None:
        return config.num_pages
    try:
        stats = device.memory_stats()
    except jax.errors.JaxRuntimeError:   # a compile-only device (jaxinfer.device.gpu_target) reports none
        stats = None
    if stats and "bytes_limit" in stats:
        free = config.memory_fraction * stats["bytes_limit"] - weight_bytes_per_device
        pages = int(free // bytes_per_page_per_device)
    else:
        pages = min(config.max_num_seqs * -(-context_length // config.page_size),
                    CPU_KV_BUDGET // bytes_per_page_per_device)
    if pages < 1:
        raise ValueError(f"no room for KV pages: {config.memory_fraction:.0%} of device memory holds the weights "
                         f"({weight_bytes_per_device:,} bytes) but not one page of {bytes_per_page_per_device:,} "
                         f"bytes; raise memory_fraction, use more devices (tp), or set num_pages")
    return pages
