"""The attention entry points models call: RoPE + KV-cache write, and ragged paged attention.

They hide how attention runs. Both take the whole step (every data-parallel replica's tokens) and run
per device under shard_map: each device sees its replica's tokens, its tp share of the heads and its
replica's pages, and calls either the pure-jnp reference ("xla", the default on CPU) or the Pallas
kernel ("pallas", the default on GPU; interpret mode on CPU). No collective is needed: attention is
local to a KV head, and a replica's requests live in its own pages.
"""

from __future__ import annotations

import jax
from flax import struct
from jax.sharding import PartitionSpec

from jaxinfer.kv_cache import POOL_AXES, PagedKVCache
from jaxinfer.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from jaxinfer.pallas_kernels.rope_cache import rope_and_write, rope_and_write_reference
from jaxinfer.sharding import Layout

BACKENDS = ("xla", "pallas")


@struct.dataclass
class StepMetadata:
    """Where each token of a flat ragged step belongs. Leading axis: the dp replica (local page ids)."""

    positions: jax.Array    # int32 [R, N] absolute position of each token
    slots: jax.Array        # int32 [R, N] cache slot page * page_size + offset; pages * page_size = padding
    page_table: jax.Array   # int32 [R, S, max_pages]
    seq_lens: jax.Array     # int32 [R, S] KV length of each sequence after this step
    query_start: jax.Array  # int32 [R, S + 1] sequence s owns tokens [query_start[s], query_start[s + 1])
    num_seqs: jax.Array     # int32 [R]
    backend: str = struct.field(pytree_node=False, default="xla")


TOKENS, META = ("batch", "seq"), {"page_table": ("batch", None, None), "seq_lens": ("batch", None),
                                  "query_start": ("batch", None), "num_seqs": ("batch",)}


def _interpret(layout: Layout) -> bool:
    return layout.mesh.devices.flat[0].platform == "cpu"


def rope_and_store(q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedKVCache, layer: jax.Array,
                   meta: StepMetadata, inv_freq: jax.Array, layout: Layout) -> tuple[jax.Array, PagedKVCache]:
    """Rotary embedding on q and k, and k/v written into their pages. q: [R, N, H, D], k, v: [R, N, KV, D]."""
    if meta.backend == "pallas":
        interpret = _interpret(layout)
        kernel = lambda *a: rope_and_write(*a, interpret=interpret)  # noqa: E731
    else:
        kernel = rope_and_write_reference

    def local(q, k, v, k_pages, v_pages, layer, positions, slots, inv_freq):
        q, k_pages, v_pages = kernel(q[0], k[0], v[0], k_pages, v_pages, layer, positions[0], slots[0], inv_freq)
        return q[None], k_pages, v_pages

    spec = layout.spec
    heads, kv_heads = spec((*TOKENS, "heads", "head_dim")), spec((*TOKENS, "kv_heads", "head_dim"))
    q, k_pages, v_pages = jax.shard_map(
        local, mesh=layout.mesh, check_vma=False,
        in_specs=(heads, kv_heads, kv_heads, spec(POOL_AXES), spec(POOL_AXES), PartitionSpec(), spec(TOKENS),
                  spec(TOKENS), PartitionSpec()),
        out_specs=(heads, spec(POOL_AXES), spec(POOL_AXES)),
    )(q, k, v, cache.k, cache.v, layer, meta.positions, meta.slots, inv_freq)
    return q, PagedKVCache(k=k_pages, v=v_pages)


def paged_attention(q: jax.Array, cache: PagedKVCache, layer: jax.Array, meta: StepMetadata,
                    layout: Layout) -> jax.Array:
    """Causal GQA attention of each token over its own sequence's pages. q: [R, N, H, D] -> [R, N, H, D]."""
    scale = 1.0 / float(q.shape[-1]) ** 0.5
    if meta.backend == "pallas":
        interpret = _interpret(layout)
        kernel = lambda *a: ragged_paged_attention(*a, sm_scale=scale, interpret=interpret)  # noqa: E731
    else:
        kernel = lambda *a: ragged_paged_attention_reference(*a, sm_scale=scale)  # noqa: E731

    def local(q, k_pages, v_pages, layer, page_table, seq_lens, query_start, num_seqs):
        return kernel(q[0], k_pages, v_pages, layer, page_table[0], seq_lens[0], query_start[0], num_seqs[0])[None]

    spec = layout.spec
    heads = spec((*TOKENS, "heads", "head_dim"))
    return jax.shard_map(
        local, mesh=layout.mesh, check_vma=False,
        in_specs=(heads, spec(POOL_AXES), spec(POOL_AXES), PartitionSpec(),
                  *(spec(META[f]) for f in ("page_table", "seq_lens", "query_start", "num_seqs"))),
        out_specs=heads,
    )(q, cache.k, cache.v, layer, meta.page_table, meta.seq_lens, meta.query_start, meta.num_seqs)


def pallas_supports(head_dim: int, page_size: int) -> bool:
    """The Triton kernels tile power-of-two dims of at least 16 (a dot's K dimension)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (head_dim, page_size))


def choose_backend(requested: str | None, platform: str, head_dim: int, page_size: int) -> str:
    """The kernels on GPU where they can serve the shapes, else the reference; an explicit choice is checked."""
    if requested is None:
        return "pallas" if platform == "gpu" and pallas_supports(head_dim, page_size) else "xla"
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "pallas" and not pallas_supports(head_dim, page_size):
        raise ValueError(f"the pallas attention backend needs head_dim and page_size to be powers of two >= 16; "
                         f"this model has head_dim {head_dim} and the cache page_size {page_size}: use "
                         f"attention_backend='xla'")
    return requested

