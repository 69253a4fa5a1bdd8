"""Paged attention per device: the kernels (or their references) under shard_map.

Each device sees its replica's tokens (one row of the step: "batch" is split over the replicas), its tp
share of the query and KV heads, and its replica's pages, so no collective is needed: attention is local
to a KV head, and a replica's requests live in its own pages.
"""

from __future__ import annotations

import functools

import jax

from jaxinfer.device.attention import cpu
from jaxinfer.device.kv_cache import POOL_AXES, PagedKVCache, scale_args
from jaxinfer.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from jaxinfer.pallas_kernels.rope_cache import rope_and_write, rope_and_write_reference
from jaxinfer.sharding import Layout
from jaxinfer.step import StepMetadata

TOKENS = ("batch", "seq")
Q, KV = (*TOKENS, "heads", "head_dim"), (*TOKENS, "kv_heads", "head_dim")
META_AXES = StepMetadata(positions=TOKENS, slots=TOKENS, page_table=("batch", None, None), seq_lens=("batch", None),
                         query_start=("batch", None), num_seqs=("batch",), token_seq=TOKENS)


def _interpret(layout: Layout) -> bool:
    return layout.platform == "cpu"


def one_replica(x: jax.Array) -> jax.Array:
    """A device holds exactly one replica's row of the step ("batch" is split over the replicas)."""
    assert x.shape[0] == 1, f"expected one replica's row per device, got {x.shape[0]}"
    return x[0]


def rope_and_store(q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedKVCache, layer: jax.Array,
                   meta: StepMetadata, inv_freq: jax.Array, layout: Layout,
                   backend: str) -> tuple[jax.Array, PagedKVCache]:
    """Rotary embedding on q and k, and k/v written into their pages (quantized there for int8/fp8 pages).
    q: [R, N, H, D], k, v: [R, N, KV, D]."""
    kernel = (functools.partial(rope_and_write, interpret=_interpret(layout)) if backend == "pallas"
              else rope_and_write_reference)

    def local(q, k, v, pools, layer, meta, inv_freq):
        q, *pools = kernel(q, k, v, *pools[:2], layer, meta.positions, meta.slots, inv_freq, **scale_args(pools))
        return q, tuple(pools)

    return _per_device(local, q, k, v, cache, layer, meta, inv_freq, layout)


def _per_device(local, q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedKVCache, layer: jax.Array,
                meta: StepMetadata, inv_freq: jax.Array, layout: Layout) -> tuple[jax.Array, PagedKVCache]:
    """local(q, k, v, pools, layer, meta, inv_freq) -> (q or attention output, pools) on each device's share:
    its replica's row of q, k, v and meta, its heads and its pages (pools: PagedKVCache.pools(), the scales of
    quantized pages included, each sharded like the pages)."""
    pools = cache.pools()

    def row(q, k, v, pools, layer, meta, inv_freq):
        out, pools = local(*map(one_replica, (q, k, v)), pools, layer, jax.tree.map(one_replica, meta), inv_freq)
        return out[None], pools

    pool_axes = (POOL_AXES,) * len(pools)
    out, pools = layout.shard_map(
        row, in_axes=(Q, KV, KV, pool_axes, None, META_AXES, None), out_axes=(Q, pool_axes), check_vma=False,
    )(q, k, v, pools, layer, meta, inv_freq)
    return out, PagedKVCache.of(pools)


def paged_attention(q: jax.Array, cache: PagedKVCache, layer: jax.Array, meta: StepMetadata, layout: Layout,
                    backend: str) -> jax.Array:
    """Causal GQA attention of each token over its own sequence's pages (dequantized as they are read for
    int8/fp8 pages). q: [R, N, H, D] -> [R, N, H, D]."""
    scale = 1.0 / float(q.shape[-1]) ** 0.5
    kernel = {"pallas": functools.partial(ragged_paged_attention, sm_scale=scale, interpret=_interpret(layout)),
              "xla": functools.partial(ragged_paged_attention_reference, sm_scale=scale)}[backend]
    pools = cache.pools()

    def local(q, pools, layer, meta):
        m = jax.tree.map(one_replica, meta)
        return kernel(one_replica(q), *pools[:2], layer, m.page_table, m.seq_lens, m.query_start, m.num_seqs,
                      **scale_args(pools))[None]

    return layout.shard_map(local, in_axes=(Q, (POOL_AXES,) * len(pools), None, META_AXES), out_axes=Q,
                            check_vma=False)(q, pools, layer, meta)


def rope_write_attend(q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedKVCache, layer: jax.Array,
                      meta: StepMetadata, inv_freq: jax.Array, layout: Layout) -> tuple[jax.Array, PagedKVCache]:
    """The "cpu" backend: rope_and_store and paged_attention as one kernel call per layer (cpu.py)."""
    scale = 1.0 / float(q.shape[-1]) ** 0.5

    def local(q, k, v, pools, layer, m, inv_freq):
        out, *pools = cpu.rope_write_attend(q, k, v, *pools[:2], layer, m.positions, m.slots, inv_freq, m.page_table,
                                            m.seq_lens, m.query_start, m.num_seqs, sm_scale=scale,
                                            **scale_args(pools))
        return out, tuple(pools)

    return _per_device(local, q, k, v, cache, layer, meta, inv_freq, layout)
