"""Attention under sequence parallel (sp): a step's tokens and every sequence's KV pages split over sp ranks.

The token axis of a step is split over the sp ranks in the load-balanced causal order (jaxinfer.engine.packer:
rank r holds chunks r and 2sp-1-r of the row), so QKV, O and the MLP run on 1/sp of the tokens on each
rank. Page i of every sequence lives on rank i mod sp (jaxinfer.engine.page_pool), so a sequence's KV, and the
work of attending over it, are spread evenly. Attention then runs one of two ways, chosen per step:

- Prefill (ring attention, `meta.ring`): the ranks' fresh K/V blocks travel the ring with sp - 1
  collective-permutes per layer, the next one issued before the current block is attended to; each rank
  writes the keys of every passing block that belong on its pages, and merges each block's partial into one
  running result (online softmax: one partial in memory, not sp). With the chunk pairing, the block from
  a rank holding earlier chunks is attended to by all queries against its first half, one holding later
  chunks by the second half of the queries against all of it, so every step after the first costs half a
  block (TransformerEngine's DualChunkSwap). A block is attended to by the backend's block kernel
  (pallas_kernels/block_attention.py: flash attention with a per-pair mask of sequence and position; the C++
  kernel on CPU, the Pallas kernel on GPU, the tiled jnp reference), so its scores take a tile's memory,
  never O(chunk x context). Keys
  cached before this step (a prefix-cache hit, earlier chunks of the prompt, decoding sequences in the
  batch) are read where they live: the queries are all-gathered, each rank attends over its own pages, and
  one all-to-all brings each rank the partials of its tokens; a step with none (`meta.cached` false: every
  sequence starts at 0) skips both collectives.
- Decode: one all-gather brings every rank all the tokens' q, k and v; each rank writes the keys that
  belong on its pages and attends every token over its own pages; one all-to-all returns each rank the
  partial outputs and log-sum-exps of its tokens. Two collectives per layer whose bytes depend on the
  tokens in the step, never on the context length (vLLM's decode context parallel).

Partials over disjoint keys are merged exactly by their log-sum-exp, in float32. A rank's own pages are
read by the backend's paged kernel with the log-sum-exp out (page stride sp, offset rank), and the ring's
blocks by its block kernel: the C++ kernels on CPU ("cpu"), the Pallas kernels on GPU ("pallas"), or the
jnp references ("xla").

Quantized pages (int8, fp8): a rank quantizes its fresh K/V once (pallas_kernels/kv_quant.py) and the
blocks travel the ring quantized, with their scales (half the bytes of each permute); each rank writes
the quantized vectors that belong on its pages as they are and attends to the block dequantized, so the
fresh keys count exactly as they will when read back from the pages, as on one device. Decode writes
through write_pages, which quantizes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.device.attention import cpu
from jaxinfer.device.attention.paged import KV, META_AXES, Q, one_replica
from jaxinfer.device.kv_cache import POOL_AXES, PagedKVCache, scale_args
from jaxinfer.pallas_kernels.block_attention import block_attention, block_attention_reference
from jaxinfer.pallas_kernels.kv_quant import dequantize, quantize
from jaxinfer.pallas_kernels.ragged_paged_attention import (
    merge_partials,
    paged_attention_partial,
    ragged_paged_attention_partial,
)
from jaxinfer.pallas_kernels.rope_cache import rope, scatter_rows, write_pages
from jaxinfer.sharding import Layout
from jaxinfer.step import StepMetadata, ring_order

ALL_TOKENS = ("batch", None)  # per-token metadata of the whole row, on every rank


def kernels(backend: str, layout: Layout) -> tuple:
    """The backend's two attention kernels with the log-sum-exp out: over a rank's pages
    (paged_attention_partial's contract) and over a ring block (block_attention_reference's)."""
    if backend == "cpu":
        return cpu.paged_attention_partial, cpu.block_attention
    if backend == "pallas":
        interpret = layout.platform == "cpu"
        return (functools.partial(ragged_paged_attention_partial, interpret=interpret),
                functools.partial(block_attention, interpret=interpret))
    return paged_attention_partial, block_attention_reference


def _merge(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Two partials (out, lse) over disjoint keys into one: the online softmax's update."""
    return merge_partials(jnp.stack([a[0], b[0]]), jnp.stack([a[1], b[1]]))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedKVCache, layer: jax.Array,
              inv_freq: jax.Array, meta: StepMetadata, layout: Layout, backend: str) -> tuple[jax.Array, PagedKVCache]:
    """RoPE, the K/V write and causal attention with tokens and pages split over sp, each rank's pages read by
    `backend`'s paged kernel. q [R, N, H, D], k and v [R, N, KV, D] (N in ring order) -> (out [R, N, H, D], cache)."""
    kernel, block_attend = kernels(backend, layout)
    (axis,) = layout.mesh_axes("seq")
    W = layout.axis_size("seq")
    if meta.ring and q.shape[1] % (2 * W):
        raise ValueError(f"a ring step's {q.shape[1]} tokens are not a multiple of 2 x sp = {2 * W} chunks "
                         "(jaxinfer.engine.packer.token_bucket)")
    scale = 1.0 / float(q.shape[-1]) ** 0.5
    ring = [(r, (r + 1) % W) for r in range(W)]

    def local(q, k, v, pools, layer, meta, inv_freq):
        q, k, v, m = q[0], k[0], v[0], jax.tree.map(one_replica, meta)
        rank, n = lax.axis_index(axis), q.shape[0]
        page, per_rank = pools[0].shape[3], pools[0].shape[2]

        def block(x: jax.Array, src) -> jax.Array:
            """The slice of a whole-row array that rank `src` holds."""
            return lax.dynamic_slice_in_dim(x, src * n, n)

        def own_slots(slots: jax.Array) -> jax.Array:
            """Slots of this rank's pages in its slice of the pool; -1 (not written here) for the others'."""
            mine = slots // page // per_rank == rank
            return jnp.where(mine, slots - rank * per_rank * page, -1)

        S, J = m.page_table.shape
        tables = m.page_table.reshape(S, J // W, W)[:, :, rank] - rank * per_rank   # this rank's pages, in order

        def over_own_pages(q_all: jax.Array, kv_limit: jax.Array) -> tuple[jax.Array, jax.Array]:
            """Every token of the row over this rank's pages, then to each rank the partials of its tokens:
            [W, n, H, D] and [W, n, H] (index: the rank whose pages they cover). The reference takes each
            sequence's tokens contiguous: the row goes back to its natural order and returns to ring order."""
            order = ring_order(n * W, W)
            natural = np.argsort(order)
            out, lse = kernel(q_all[natural], m.query_start, m.num_seqs, kv_limit[natural], *pools[:2], layer, tables,
                              sm_scale=scale, page_stride=W, page_offset=rank, **scale_args(pools))
            out, lse = out[order], lse[order]
            both = lax.all_to_all(jnp.concatenate([out, lse[..., None]], -1), axis, 0, 0, tiled=True)
            both = both.reshape(W, n, *both.shape[1:])
            return both[..., :-1], both[..., -1]

        pos, tseq = block(m.positions, rank), block(m.token_seq, rank)
        q, k = rope(q, pos, inv_freq), rope(k, pos, inv_freq)
        if meta.ring:
            fresh = _ring_block(k, v, pools)   # one permute per step (two with scales)
            for i in range(W):
                following = lax.ppermute(fresh, axis, ring) if i < W - 1 else None   # issued before the compute
                src = (rank - i) % W
                pools = _write_block(pools, layer, fresh, own_slots(block(m.slots, src)))
                kv = _block_values(fresh, q.dtype)
                keys = (kv[:, 0], kv[:, 1], block(m.positions, src), block(m.token_seq, src))
                if i == 0:
                    acc = block_attend(q, pos, tseq, *keys, sm_scale=scale)
                else:
                    acc = _merge(acc, _half_block(block_attend, q, pos, tseq, *keys, src < rank, scale))
                fresh = following
            if meta.cached:
                q_len = m.query_start[1:] - m.query_start[:-1]
                before = (m.seq_lens - q_len)[jnp.maximum(m.token_seq, 0)]   # each token's sequence before this step
                outs, lses = over_own_pages(lax.all_gather(q, axis, tiled=True), before)
                acc = merge_partials(jnp.concatenate([acc[0][None], outs]), jnp.concatenate([acc[1][None], lses]))
            out = acc[0]
        else:
            qkv = lax.all_gather(jnp.concatenate([q, k, v], axis=1), axis, tiled=True)
            h, kvh = q.shape[1], k.shape[1]
            pools = write_pages(*pools[:2], layer, qkv[:, h: h + kvh], qkv[:, h + kvh:], own_slots(m.slots),
                                **scale_args(pools))
            outs, lses = over_own_pages(qkv[:, :h], m.positions + 1)
            out, _ = merge_partials(outs, lses)
        return out.astype(q.dtype)[None], tuple(pools)

    axes = META_AXES.replace(positions=ALL_TOKENS, slots=ALL_TOKENS, token_seq=ALL_TOKENS, ring=meta.ring,
                             cached=meta.cached)
    pools = cache.pools()
    pool_axes = (POOL_AXES,) * len(pools)
    out, pools = layout.shard_map(
        local, in_axes=(Q, KV, KV, pool_axes, None, axes, None), out_axes=(Q, pool_axes), check_vma=False,
    )(q, k, v, pools, layer, meta, inv_freq)
    return out, PagedKVCache.of(pools)


def _ring_block(k: jax.Array, v: jax.Array, pools: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """A rank's fresh keys and values as they travel the ring: ([n, 2, KV, D],) in the model's dtype, or for
    quantized pages (elements [n, 2, KV, D] of the pool's dtype, bfloat16 scales [n, 2, KV, 1])."""
    kv = jnp.stack([k, v], axis=1)
    if len(pools) == 2:
        return (kv,)
    return quantize(kv, pools[0].dtype)


def _write_block(pools: tuple[jax.Array, ...], layer: jax.Array, block: tuple[jax.Array, ...],
                 slots: jax.Array) -> tuple[jax.Array, ...]:
    """A travelling block into this rank's pages (slots -1: not here), already quantized where pages are."""
    if len(pools) == 2:
        return write_pages(*pools, layer, block[0][:, 0], block[0][:, 1], slots)
    (x, scales), (k_pages, v_pages, k_scales, v_scales) = block, pools
    return (scatter_rows(k_pages, layer, x[:, 0], slots), scatter_rows(v_pages, layer, x[:, 1], slots),
            scatter_rows(k_scales, layer, scales[:, 0], slots), scatter_rows(v_scales, layer, scales[:, 1], slots))


def _block_values(block: tuple[jax.Array, ...], dtype) -> jax.Array:
    """The block's keys and values [n, 2, KV, D] as attention sees them: dequantized where they travel quantized."""
    return block[0] if len(block) == 1 else dequantize(*block, dtype)


def _half_block(block_attend, q, q_pos, q_seq, k, v, k_pos, k_seq, earlier: jax.Array,
                scale: float) -> tuple[jax.Array, jax.Array]:
    """A block from another rank under the chunk pairing: from a rank with earlier chunks (`earlier`) only
    its first chunk is visible, to all queries; from one with later chunks only the second chunk of the
    queries sees it. Half the work of the whole block, the same result."""
    h = q.shape[0] // 2

    def first_half_of_keys():
        return block_attend(q, q_pos, q_seq, k[:h], v[:h], k_pos[:h], k_seq[:h], sm_scale=scale)

    def second_half_of_queries():
        out, lse = block_attend(q[h:], q_pos[h:], q_seq[h:], k, v, k_pos, k_seq, sm_scale=scale)
        return (jnp.concatenate([jnp.zeros_like(out), out]),
                jnp.concatenate([jnp.full_like(lse, -jnp.inf), lse]))

    return lax.cond(earlier, first_half_of_keys, second_half_of_queries)
