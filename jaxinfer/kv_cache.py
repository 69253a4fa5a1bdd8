"""The KV cache behind one interface. This version is contiguous: one slot of `length` positions per row.

The forward pass sees only `KVCache.write` (store new keys/values at their positions) and the layer
slices `k`/`v`; the paged pool that replaces it keeps the same two entry points.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.sharding import Axes, Layout

CACHE_AXES: Axes = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")


@struct.dataclass
class KVCache:
    k: jax.Array  # [layers, batch, length, kv_heads, head_dim]
    v: jax.Array

    @classmethod
    def zeros(cls, layers: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype,
              layout: Layout | None = None) -> KVCache:
        shape = (layers, batch, length, kv_heads, head_dim)
        sharding = layout.sharding(CACHE_AXES) if layout is not None else None
        make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return cls(k=make(), v=make())

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def write(layer_cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Store new[b, t] at layer_cache[b, start[b] + t]. An elementwise select, not a scatter, so it shards
    over batch and heads with no communication; positions past the cache end are dropped."""
    T, S = new.shape[1], layer_cache.shape[1]
    offset = jnp.arange(S)[None, :] - start[:, None]                       # [B, S]
    taken = jnp.take_along_axis(new, jnp.clip(offset, 0, T - 1)[:, :, None, None], axis=1)
    inside = ((offset >= 0) & (offset < T))[:, :, None, None]
    return jnp.where(inside, taken.astype(layer_cache.dtype), layer_cache)
