"""The paged KV cache on device: one pool of pages per layer, addressed through page tables.

Layout [layers, kv_heads, pages, page_size, head_dim]: a page of one KV head is one contiguous
[page_size, head_dim] tile (what a GPU kernel loads), KV heads shard over tp, and the pages axis over
dp, so each data-parallel replica owns its own slice of the pool and indexes it with local page ids.
The host side (free list, reference counts, prefix cache) is jaxinfer/page_pool.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.sharding import Axes, Layout

POOL_AXES: Axes = ("layers", "kv_heads", "pages", None, "head_dim")


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


def pages_from_budget(device: jax.Device, weight_bytes_per_device: int, bytes_per_page_per_device: int,
                      memory_fraction: float) -> int | None:
    """Pages that fit in `memory_fraction` of a device's memory after its weights (vLLM's
    gpu_memory_utilization); None where the device does not report its memory (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    free = memory_fraction * stats["bytes_limit"] - weight_bytes_per_device
    return max(int(free // bytes_per_page_per_device), 0)
