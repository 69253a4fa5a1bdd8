"""The one attention entry point models call (through StepContext.attention), and the choice of backend.

`attention` = RoPE on q and k, k/v written into their cache pages, then causal attention of each token
over its own sequence's pages. How it runs is engine configuration, not model code:
- "xla": the pure-jnp references, on any platform;
- "cpu": a C++ kernel XLA:CPU calls through its FFI (cpu.py), the default on CPU where it builds;
- "pallas": the Pallas GPU kernels (interpret mode on CPU), the default on GPU where they tile the shapes.
All run per device (paged.py); RoPE and the cache writes are the references' under "xla", a kernel of
their own under "pallas", and part of the attention kernel's one call per layer under "cpu".
Under sequence parallel (sp > 1) attention is ring.py's: ring attention for prefill and decode over KV
pages sharded across sp, each rank's pages read by the backend's kernel with its log-sum-exp out.
Every backend serves quantized pages too (EngineConfig.kv_cache_dtype int8 / fp8; jaxinfer/device/kv_cache.py):
K and V quantized where they are written, dequantized inside attention where the pages are read.
"""

from __future__ import annotations

import chex
import jax

from jaxinfer.config import ATTENTION_BACKENDS
from jaxinfer.device.attention import cpu, paged, ring
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.sharding import Layout
from jaxinfer.step import StepMetadata

BACKENDS = ATTENTION_BACKENDS


def attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedKVCache, layer: jax.Array,
              inv_freq: jax.Array, meta: StepMetadata, layout: Layout, backend: str) -> tuple[jax.Array, PagedKVCache]:
    """q [R, N, H, D], k and v [R, N, KV, D] -> (attention output [R, N, H, D], the cache with this step's K/V)."""
    chex.assert_rank([q, k, v], 4)
    chex.assert_equal_shape([k, v])
    chex.assert_equal_shape([q, k], dims=(0, 1, 3))
    chex.assert_type([k, v], q.dtype)
    chex.assert_shape(inv_freq, (q.shape[-1] // 2,))
    chex.assert_equal_shape([cache.k, cache.v])
    if layout.axis_size("seq") > 1:
        return ring.attention(q, k, v, cache, layer, inv_freq, meta, layout, backend)
    if backend == "cpu":
        return paged.rope_write_attend(q, k, v, cache, layer, meta, inv_freq, layout)
    q, cache = paged.rope_and_store(q, k, v, cache, layer, meta, inv_freq, layout, backend)
    return paged.paged_attention(q, cache, layer, meta, layout, backend), cache


def pallas_supports(head_dim: int, page_size: int) -> bool:
    """The Triton kernels tile power-of-two dims of at least 16 (a dot's K dimension)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (head_dim, page_size))


def choose_backend(requested: str | None, platform: str, head_dim: int, page_size: int) -> str:
    """The platform's kernel where it can serve the shapes (Pallas on GPU, the C++ kernel on CPU), else the
    reference; an explicit choice is checked. Under sp the same kernels read each rank's pages (ring.py)."""
    if requested is None:
        if platform == "gpu" and pallas_supports(head_dim, page_size):
            return "pallas"
        return "cpu" if platform == "cpu" and cpu.available() else "xla"
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "pallas" and not pallas_supports(head_dim, page_size):
        raise ValueError(f"the pallas attention backend needs head_dim and page_size to be powers of two >= 16; "
                         f"this model has head_dim {head_dim} and the cache page_size {page_size}: use "
                         f"attention_backend='xla'")
    if requested == "cpu" and platform != "cpu":
        raise ValueError(f"the cpu attention backend runs on CPU devices only, not {platform}")
    if requested == "cpu" and not cpu.available():
        raise ValueError(f"the cpu attention kernel could not be built: {cpu.unavailable_reason()}")
    return requested
