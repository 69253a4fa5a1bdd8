"""The paged KV cache on device: one pool of pages per layer, addressed through page tables.

Layout [layers, kv_heads, pages, page_size, head_dim]: a page of one KV head is one contiguous
[page_size, head_dim] tile (what a GPU kernel loads), KV heads shard over tp, and the pages axis over
dp, so each data-parallel replica owns its own slice of the pool and indexes it with local page ids.
The host side (free pages and their placement, reference counts, prefix cache) is jaxinfer/engine/page_pool.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.config import EngineConfig
from jaxinfer.sharding import Axes, Layout

POOL_AXES: Axes = ("layers", "kv_heads", "pages", None, "head_dim")
CPU_KV_BUDGET = 2 << 30  # bytes of KV pages per device where the device does not report its memory


@struct.dataclass
class PagedKVCache:
    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, layers: int, kv_heads: int, pages: int, page_size: int, head_dim: int, dtype,
              layout: Layout) -> PagedKVCache:
        shape = (layers, kv_heads, pages, page_size, head_dim)
        make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=layout.sharding(POOL_AXES))
        return cls(k=make(), v=make())


def page_bytes(layers: int, kv_heads: int, page_size: int, head_dim: int, dtype) -> int:
    """Bytes of one page of K and V across all layers and (replicated) KV heads."""
    return 2 * layers * kv_heads * page_size * head_dim * jnp.dtype(dtype).itemsize


def pool_pages(config: EngineConfig, device: jax.Device, weight_bytes_per_device: int, bytes_per_page_per_device: int,
               context_length: int) -> int:
    """Pages per replica: config.num_pages, else what fits in `memory_fraction` of a device's memory after
    its weights (vLLM's gpu_memory_utilization); where the device does not report its memory (CPU), enough
    for max_num_seqs full contexts within CPU_KV_BUDGET."""
    if config.num_pages is not None:
        return config.num_pages
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
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
