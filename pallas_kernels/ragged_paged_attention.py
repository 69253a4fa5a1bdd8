"""Ragged paged attention: one step's flat batch of query tokens over a paged KV pool.

A step mixes decode tokens (q_len 1) and prefill chunks (q_len > 1) of many sequences. Sequence s owns
query tokens [query_start[s], query_start[s + 1]) whose absolute positions end at seq_lens[s] - 1; its
keys/values (this step's included) sit in pages `page_table[s]` of the pool `[L, KV, pages, P, D]`.
Query head h reads kv head h // (H // KV). Tokens at or after query_start[num_seqs] are padding: output 0.
With `return_lse=True` both also return the log-sum-exp of each row's scaled scores (float32 [N, H], -inf
for padding): what merging partial attention over disjoint sets of pages needs (o = sum_i w_i o_i with
w_i = exp(lse_i - logsumexp_i lse_i)).

Two implementations with one contract:
- `ragged_paged_attention_reference`: jax.numpy, the engine's CPU path. It goes sequence by sequence,
  each over its own pages only (gathered once per sequence, a block of pages at a time), so a step costs
  what its sequences need, not N tokens x the longest one; memory is O(N x H x D), never O(N x max_len).
  A decode step whose sequences are of similar length attends all its tokens at once instead
  (`together_pays`): the same reads, in fewer and larger kernels.
- `ragged_paged_attention`: a Pallas kernel lowered through Triton. Grid (query block, kv head); a block
  is up to `block_q` tokens of one sequence times the G = H / KV query heads of its kv head, i.e.
  block_q * G rows of one matmul tile, with an online softmax over the pages it needs.
Both read quantized pages (int8 or float8_e4m3fn, `k_scales`/`v_scales` [L, KV, pages, P, 1] beside them):
each page is dequantized to q's dtype as it is gathered or loaded (pallas_kernels/kv_quant.py), and all
that follows is the unquantized computation.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas_kernels.kv_quant import dequantize, is_quantized

_LOG2E = math.log2(math.e)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so a fully masked page gives p = 0, not NaN
_TILE_ROWS = 16  # rows of the smallest MMA tile: the default block fills it and no more (see _pick_block_q)
BLOCK_Q = 32      # reference: tokens of a prefill chunk per online-softmax update
BLOCK_PAGES = (8, 16)   # reference: table entries gathered per block, for decode tokens and prefill chunks


def _token_seq(query_start: jax.Array, n: int) -> jax.Array:
    """The sequence slot of each of n flat tokens (S past the last slot's end). A comparison per token and
    slot, not a binary search: one fused kernel, where a search is a loop of several to compile."""
    tok = jnp.arange(n, dtype=jnp.int32)
    return (tok[:, None] >= query_start[None, 1:]).sum(-1, dtype=jnp.int32)


def _token_map(seq_lens: jax.Array, query_start: jax.Array, num_seqs: jax.Array,
               n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sequence, absolute position and validity of each flat query token."""
    tok = jnp.arange(n, dtype=jnp.int32)
    seq = jnp.minimum(_token_seq(query_start, n), seq_lens.shape[0] - 1)
    start = query_start[seq]
    pos = seq_lens[seq] - (query_start[seq + 1] - start) + (tok - start)
    return seq, pos, tok < query_start[num_seqs]


def ragged_paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array,
                                     page_table: jax.Array, seq_lens: jax.Array, query_start: jax.Array,
                                     num_seqs: jax.Array, *, sm_scale: float, return_lse: bool = False,
                                     k_scales: jax.Array | None = None, v_scales: jax.Array | None = None
                                     ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Each sequence's query tokens over its own pages, causal. q: [N, H, D] -> [N, H, D] in q.dtype
    (and the log-sum-exp [N, H] float32 with return_lse). Quantized pages: their scales [L, KV, pages, P, 1]."""
    chex.assert_rank([q, k_pages, page_table, seq_lens, query_start], [3, 5, 2, 1, 1])
    chex.assert_shape(query_start, (seq_lens.shape[0] + 1,))
    _, pos, valid = _token_map(seq_lens, query_start, num_seqs, q.shape[0])
    out, lse = paged_attention_partial(q, query_start, num_seqs, jnp.where(valid, pos + 1, 0), k_pages, v_pages,
                                       layer, page_table, sm_scale=sm_scale, k_scales=k_scales, v_scales=v_scales)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def paged_attention_partial(q: jax.Array, query_start: jax.Array, num_seqs: jax.Array, kv_limit: jax.Array,
                            k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array, page_table: jax.Array, *,
                            sm_scale: float, page_stride: int = 1, page_offset: jax.Array | int = 0,
                            block_q: int = BLOCK_Q, block_pages: tuple[int, int] = BLOCK_PAGES,
                            k_scales: jax.Array | None = None, v_scales: jax.Array | None = None
                            ) -> tuple[jax.Array, jax.Array]:
    """Attention of each query token over part of its sequence's keys: the general form of the reference.

    Sequence s < num_seqs owns tokens [query_start[s], query_start[s + 1]); token n reads its keys at
    positions below kv_limit[n] (causal: position + 1; none when 0); tokens of no sequence read none.
    Entry j of a page table holds the sequence's page j * page_stride + page_offset: a rank of sp holds
    every sp-th page. Returns float32 (out [N, H, D], lse [N, H]), 0 and -inf where no key is visible, so
    partials over disjoint pages merge exactly (`merge_partials`).

    A loop over the sequences; each walks its own table entries up to what its tokens need, gathering
    each block of entries once, and a block's keys update the online softmax of the sequence's tokens
    that see any of them, a window of W tokens at a time. Work follows each sequence's own length and
    query count, never the step's longest; memory is O(N x H x D) for the state plus one block of K/V.
    W = 1 for a one-token sequence (a decode pays for one row), block_q for longer ones; blocks hold
    block_pages[0] table entries at W = 1, block_pages[1] otherwise: fixed sizes, not the table's width
    (an engine's tables are as wide as its longest sequence), so a short sequence gathers at most a block
    of entries it does not need, and a prompt chunk's larger blocks take fewer, larger kernels. XLA:CPU
    compiles every kernel on its own, so each window size costs a copy of the attention body in compile
    time: a shape that holds only one kind of sequence gets one (`_windows`). A decode shape (no more
    tokens than slots) also holds a batched path, taken at run time when no sequence needs more than
    twice the table entries of the average one (`together_pays`): every token over the same block of
    its own sequence's entries at once, so the per-sequence loop's fixed cost is paid once per block.
    Quantized pages (k_scales, v_scales given) are dequantized to q's dtype as each block is gathered
    (pallas_kernels/kv_quant.py), so all that follows is the unquantized computation on those values.
    """
    chex.assert_rank([q, k_pages, page_table, query_start, kv_limit], [3, 5, 2, 1, 1])
    chex.assert_equal_shape([k_pages, v_pages])
    chex.assert_shape(kv_limit, q.shape[:1])
    chex.assert_shape(query_start, (page_table.shape[0] + 1,))
    n, h, d = q.shape
    _, kv, num_pages, page, _ = k_pages.shape
    (slots, width), group = page_table.shape, h // kv
    windows = _windows(n, slots, block_q)
    rows = n + windows[-1]                                   # room for a window that starts at the last token
    tables = jnp.pad(page_table, ((0, 0), (0, max(block_pages))))  # a sequence's last block may run past the width
    qt = jnp.pad(q.reshape(n, kv, group, d).transpose(1, 0, 2, 3), ((0, 0), (0, rows - n), (0, 0), (0, 0)))
    tok = np.arange(rows, dtype=np.int32)   # numpy constants here and below: nothing to compute at run time
    seq = _token_seq(query_start, rows)
    limit = jnp.where(seq < num_seqs, jnp.pad(kv_limit.astype(jnp.int32), (0, rows - n)), 0)
    # per sequence: table entries j with (j * stride + offset) * page < limit, for its neediest token
    most = jnp.where(seq == np.arange(slots, dtype=np.int32)[:, None], limit, 0).max(-1)
    needed = jnp.clip((-(-most // page) - page_offset + page_stride - 1) // page_stride, 0, width)

    def gather(pid: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K and V of pages `pid` (any shape) of the layer: [*pid.shape, KV, P, D], dequantized if need be."""
        k, v = k_pages[layer, :, pid], v_pages[layer, :, pid]
        if k_scales is None:
            return k, v
        return dequantize(k, k_scales[layer, :, pid], q.dtype), dequantize(v, v_scales[layer, :, pid], q.dtype)

    def sequence(s, state):
        t0, t_end = query_start[s], query_start[s + 1]
        lim = jnp.where(seq == s, limit, 0)                  # 0 for tokens of other sequences

        def blocks(window: int, one_token: bool, state):
            """The sequence's blocks of table entries, each into its tokens, `window` at a time."""
            size = min(block_pages[window > 1], width)
            key_offsets = (np.arange(size, dtype=np.int32)[:, None] * page_stride * page
                           + np.arange(page, dtype=np.int32)).reshape(-1)

            def kv_block(b, state):
                pid = jnp.clip(lax.dynamic_slice(tables, (s, b * size), (1, size))[0], 0, num_pages - 1)
                k, v = (x.transpose(1, 0, 2, 3).reshape(kv, size * page, d) for x in gather(pid))  # [KV, C, D]
                v = jnp.concatenate([v, jnp.ones_like(v[..., :1])], -1)   # p @ [v | 1]: the denominator too
                first_key = (b * size * page_stride + page_offset) * page
                update = functools.partial(_update, window=window, qt=qt, lim=lim, k=k, v=v,
                                           key_pos=first_key + key_offsets, sm_scale=sm_scale)
                if one_token:
                    return update(state, t0)
                first = jnp.min(jnp.where(lim > first_key, tok, t_end))   # first token that sees one of them
                return lax.fori_loop(0, (t_end - first + window - 1) // window,
                                     lambda i, st: update(st, first + i * window), state)

            return lax.fori_loop(0, (needed[s] + size - 1) // size, kv_block, state)

        if len(windows) == 1:
            return blocks(windows[0], False, state)
        return lax.cond(t_end - t0 == 1, functools.partial(blocks, 1, True), functools.partial(blocks, block_q, False),
                        state)

    def together(state):
        """Every token at once, a block of table entries at a time, each token over its own sequence's
        entries: one set of kernels per block instead of one per sequence, paying for the neediest one."""
        size = min(block_pages[0], width)
        key_offsets = (np.arange(size, dtype=np.int32)[:, None] * page_stride * page
                       + np.arange(page, dtype=np.int32)).reshape(-1)
        rows_seq = jnp.minimum(seq[:n], slots - 1)                       # the n real tokens' sequences

        def kv_block(b, state):
            block = lax.dynamic_slice_in_dim(tables, b * size, size, axis=1)[rows_seq]       # [n, size]
            pid = jnp.clip(block, 0, num_pages - 1)
            k, v = (x.transpose(2, 0, 1, 3, 4).reshape(kv, n, size * page, d)  # [KV, n, C, D]
                    for x in gather(pid))
            first_key = (b * size * page_stride + page_offset) * page
            visible = first_key + key_offsets[None, :] < limit[:n, None]  # [n, C]
            s = jnp.einsum("kwgd,kwcd->kwgc", qt[:, :n], k, preferred_element_type=jnp.float32) * sm_scale
            s = jnp.where(visible[None, :, None, :], s, _MASK)
            m = state[..., -1]
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            pv = jnp.einsum("kwgc,kwcd->kwgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            denom = p.sum(-1, keepdims=True)
            corr = jnp.exp(m - m_new)[..., None]
            return jnp.concatenate([corr * state[..., :-1] + jnp.concatenate([pv, denom], -1), m_new[..., None]], -1)

        done = lax.fori_loop(0, (needed.max() + size - 1) // size, kv_block, state[:, :n])
        return state.at[:, :n].set(done)       # the row past the last token is the loop's room, unused here

    # per token and head: the output accumulator, the softmax denominator, the running max
    state = jnp.concatenate([jnp.zeros((kv, rows, group, d + 1), jnp.float32),
                             jnp.full((kv, rows, group, 1), -jnp.inf, jnp.float32)], axis=-1)
    if windows == (1,) and slots <= 2:   # together_pays always holds: num_seqs x max <= 2 x sum
        state = together(state)
    elif windows == (1,):   # one token per sequence or nearly (a decode step's shape): decide at run time
        state = lax.cond(together_pays(needed, num_seqs), together,
                         lambda st: lax.fori_loop(0, num_seqs, sequence, st), state)
    else:
        state = lax.fori_loop(0, num_seqs, sequence, state)
    acc, denom, m = state[:, :n, :, :d], state[:, :n, :, d], state[:, :n, :, d + 1]
    seen = m > _MASK                  # some key was visible (with none, masked keys would add p = 1 each)
    out = jnp.where(seen[..., None], acc / jnp.where(denom > 0, denom, 1.0)[..., None], 0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out.transpose(1, 0, 2, 3).reshape(n, h, d), lse.transpose(1, 0, 2).reshape(n, h)


def together_pays(needed: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """Whether a decode-shaped step attends all its tokens at once (each over as many table entries as the
    neediest sequence) rather than sequence by sequence: when that reads at most twice the entries the
    sequences need. Sequences of similar length take the batched path and its fewer, larger kernels; a
    long one among short ones keeps the loop, whose work follows each sequence's own length."""
    return num_seqs * needed.max() <= 2 * needed.sum()


def _windows(tokens: int, slots: int, block_q: int) -> tuple[int, ...]:
    """Window sizes for a step shape: (1,) with no more tokens than sequence slots (decode steps; a longer
    sequence there goes a token at a time), (min(tokens, block_q),) with one slot, else (1, block_q), one
    or the other per sequence by its token count."""
    if tokens <= slots:
        return (1,)
    if slots == 1:
        return (min(tokens, block_q),)
    return (1, block_q)


def _update(state: jax.Array, t: jax.Array, *, window: int, qt: jax.Array, lim: jax.Array, k: jax.Array,
            v: jax.Array, key_pos: jax.Array, sm_scale: float) -> jax.Array:
    """Online softmax step of tokens [t, t + window) over one block of keys (k [KV, C, D], v [KV, C, D + 1]
    with a column of ones) in the state [KV, rows, G, D + 2] (accumulator, denominator, running max).
    A window may reach into the next sequence's tokens: their limit is 0 here, so all their scores are
    _MASK, which changes nothing once they have seen a key (p = 0) and is wiped out by the first key
    they see (corr = 0); with none ever, they end as unseen."""
    old = lax.dynamic_slice_in_dim(state, t, window, axis=1)
    m = old[..., -1]
    q = lax.dynamic_slice_in_dim(qt, t, window, axis=1)                         # [KV, W, G, D]
    s = jnp.einsum("kwgd,kcd->kwgc", q, k, preferred_element_type=jnp.float32) * sm_scale
    visible = key_pos[None, :] < lax.dynamic_slice_in_dim(lim, t, window)[:, None]     # [W, C]
    s = jnp.where(visible[None, :, None, :], s, _MASK)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("kwgc,kcd->kwgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [.., D + 1]
    new = jnp.concatenate([corr[..., None] * old[..., :-1] + pv, m_new[..., None]], -1)
    return lax.dynamic_update_slice_in_dim(state, new, t, axis=1)


def merge_partials(outs: jax.Array, lses: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact attention from partials over disjoint key sets: outs [K, ..., D], lses [K, ...] (float32, -inf
    where a part saw no key) -> (out [..., D], lse [...]); 0 and -inf where no part saw a key."""
    lse = jax.nn.logsumexp(lses, axis=0)
    finite = jnp.isfinite(lse)
    w = jnp.where(finite, jnp.exp(lses - jnp.where(finite, lse, 0)), 0)    # exp(-inf - x) = 0 guards empty parts
    return (w[..., None] * outs).sum(0), lse


def _pick_block_q(group: int) -> int:
    """Default tokens per block: block_q * G fills one 16-row MMA tile.

    Decode blocks hold one real token, so every row past G is wasted work; with 16 rows the waste is at
    most one minimal tile, which the K/V page loads (the real cost of decode) hide. Prefill chunks get
    16 rows too, like vLLM's unified attention; consecutive blocks of a sequence reuse its pages in L2.
    """
    return max(1, _TILE_ROWS // group)


def _block_map(query_start: jax.Array, num_seqs: jax.Array, block_q: int, num_blocks: int) -> jax.Array:
    """int32 [num_blocks, 3]: (sequence or -1 past the real blocks, first token, end token)."""
    num_slots = query_start.shape[0] - 1
    q_len = jnp.where(jnp.arange(num_slots) < num_seqs, query_start[1:] - query_start[:-1], 0)
    blocks_end = jnp.cumsum((q_len + block_q - 1) // block_q)
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(blocks_end, b, side="right"), num_slots - 1).astype(jnp.int32)
    first = (b - (blocks_end[seq] - (q_len[seq] + block_q - 1) // block_q)) * block_q   # offset in the seq
    return jnp.stack([jnp.where(b < blocks_end[-1], seq, -1), query_start[seq] + first, query_start[seq + 1]],
                     axis=1).astype(jnp.int32)


def visible_keys(kv_limit: jax.Array, page: int, width: int, page_stride: int = 1,
                 page_offset: jax.Array | int = 0) -> jax.Array:
    """int32 [N]: how many keys along its sequence's table each token sees, when table entry j holds the
    sequence's page j * page_stride + page_offset and the token sees positions below kv_limit. Positions grow
    along the table, so they are a prefix of it: the entries wholly below the limit, and part of the next."""
    limit = kv_limit.astype(jnp.int32)
    entries = jnp.clip((-(-limit // page) - page_offset + page_stride - 1) // page_stride, 0, width)
    last_first = ((entries - 1) * page_stride + page_offset) * page       # first position of the last entry
    return jnp.where(entries > 0, (entries - 1) * page + jnp.clip(limit - last_first, 0, page), 0)


def _kernel(blocks_ref, layer_ref, page_table_ref, visible_ref, q_ref, k_ref, v_ref, *refs, block_q: int, group: int,
            page: int, scale: float, quantized: bool):
    """One (query block, kv head) program: block_q tokens x G heads as rows, online softmax over the first
    visible[t] keys along the sequence's table (scores in log2 units: `scale` includes log2(e)); the
    log-sum-exp, in natural log, where asked. A row that sees no key gets 0 and -inf.
    refs: the scales of quantized pages (k, v), then the output and the log-sum-exp where asked."""
    ks_ref, vs_ref, o_ref, *lse = refs if quantized else (None, None, *refs)
    lse_ref = lse[0] if lse else None
    b, h = pl.program_id(0), pl.program_id(1)
    seq = blocks_ref[b, 0]

    @pl.when(seq >= 0)
    def _():
        t0, t_end = blocks_ref[b, 1], blocks_ref[b, 2]
        d = q_ref.shape[-1]
        rows = block_q * group
        window = (pl.ds(t0, block_q), pl.ds(h * group, group), slice(None))
        real = (t0 + jnp.arange(block_q)) < t_end
        io_mask = jnp.broadcast_to(real[:, None, None], (block_q, group, d))
        q = plgpu.load(q_ref.at[window], mask=io_mask, other=0).reshape(rows, d)
        visible = plgpu.load(visible_ref.at[pl.ds(t0, block_q)], mask=real, other=0)
        row_visible = jnp.broadcast_to(visible[:, None], (block_q, group)).reshape(rows)
        n_pages = (visible.max() + page - 1) // page
        layer = layer_ref[0]

        def body(j, carry):
            acc, m, denom = carry
            pid = page_table_ref[seq, j]
            k, v = k_ref[layer, h, pid], v_ref[layer, h, pid]                # [P, D] each
            if quantized:   # dequantized in registers: the page's bytes read are the quantized ones
                k = dequantize(k, ks_ref[layer, h, pid], q.dtype)             # scales [P, 1]
                v = dequantize(v, vs_ref[layer, h, pid], q.dtype)
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
            s = jnp.where((j * page + jnp.arange(page))[None, :] < row_visible[:, None], s, _MASK)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.exp2(s - m_new[:, None])
            corr = jnp.exp2(m - m_new)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            return acc * corr[:, None] + pv, m_new, denom * corr + p.sum(axis=1)

        init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
        acc, m, denom = lax.fori_loop(0, n_pages, body, init)
        seen = row_visible > 0
        out = jnp.where(seen[:, None], acc / jnp.where(seen, denom, 1.0)[:, None], 0)
        plgpu.store(o_ref.at[window], out.astype(o_ref.dtype).reshape(block_q, group, d), mask=io_mask)
        if lse_ref is not None:
            lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, denom, 1.0))) / _LOG2E, -jnp.inf)
            plgpu.store(lse_ref.at[window[:2]], lse.reshape(block_q, group),
                        mask=jnp.broadcast_to(real[:, None], (block_q, group)))


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _check_shapes(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> None:
    """Refuse what Triton cannot tile, before lowering: power-of-two tensor dims, dot dims >= 16."""
    (_, h, d), (_, kv, _, page, kd) = q.shape, k_pages.shape
    if k_pages.shape != v_pages.shape or kd != d:
        raise ValueError(f"k_pages {k_pages.shape} / v_pages {v_pages.shape} do not match q {q.shape}")
    if h % kv:
        raise ValueError(f"{h} query heads are not a multiple of {kv} kv heads")
    if not _is_pow2(d) or d < 16:
        raise ValueError(f"head_dim {d} must be a power of two >= 16 for the Triton kernel (dot K dimension)")
    if not _is_pow2(page) or page < 16:
        raise ValueError(f"page size {page} must be a power of two >= 16 for the Triton kernel")


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array,
                           page_table: jax.Array, seq_lens: jax.Array, query_start: jax.Array,
                           num_seqs: jax.Array, *, sm_scale: float, block_q: int | None = None,
                           interpret: bool = False, return_lse: bool = False, k_scales: jax.Array | None = None,
                           v_scales: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Pallas (Triton) ragged paged attention; same contract as `ragged_paged_attention_reference`.

    block_q: tokens per query block (power of two); None picks 16 // G so decode wastes little.
    k_scales, v_scales: quantized pages' scales [L, KV, pages, P, 1]; each page is dequantized to q's dtype
    as it is loaded.
    """
    _, pos, valid = _token_map(seq_lens, query_start, num_seqs, q.shape[0])
    visible = jnp.where(valid, jnp.minimum(pos + 1, page_table.shape[1] * k_pages.shape[3]), 0)
    out, lse = _pallas_attention(q, k_pages, v_pages, layer, page_table, query_start, num_seqs, visible,
                                 sm_scale=sm_scale, block_q=block_q, interpret=interpret, out_dtype=q.dtype,
                                 k_scales=k_scales, v_scales=v_scales)
    return (out, lse) if return_lse else out


def ragged_paged_attention_partial(q: jax.Array, query_start: jax.Array, num_seqs: jax.Array, kv_limit: jax.Array,
                                   k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array, page_table: jax.Array, *,
                                   sm_scale: float, page_stride: int = 1, page_offset: jax.Array | int = 0,
                                   block_q: int | None = None, interpret: bool = False,
                                   k_scales: jax.Array | None = None,
                                   v_scales: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Pallas (Triton) `paged_attention_partial`: float32 (out [N, H, D], lse [N, H]) of each token over its
    sequence's table entries (entry j: page j * page_stride + page_offset) at positions below kv_limit, 0 and
    -inf where none is visible; what sequence parallel's ranks merge."""
    chex.assert_shape(kv_limit, q.shape[:1])
    tok_seq = _token_seq(query_start, q.shape[0])
    limit = jnp.where(tok_seq < num_seqs, kv_limit, 0)
    visible = visible_keys(limit, k_pages.shape[3], page_table.shape[1], page_stride, page_offset)
    return _pallas_attention(q, k_pages, v_pages, layer, page_table, query_start, num_seqs, visible,
                             sm_scale=sm_scale, block_q=block_q, interpret=interpret, out_dtype=jnp.float32,
                             k_scales=k_scales, v_scales=v_scales)


def _pallas_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array, page_table: jax.Array,
                      query_start: jax.Array, num_seqs: jax.Array, visible: jax.Array, *, sm_scale: float,
                      block_q: int | None, interpret: bool, out_dtype, k_scales: jax.Array | None,
                      v_scales: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The kernel's call: each real token over the first visible[t] keys along its sequence's table ->
    (out [N, H, D] in out_dtype, lse [N, H] float32), 0 and -inf for padding and for tokens that see none."""
    n, h, d = q.shape
    num_layers, kv, _, page, _ = k_pages.shape
    _check_shapes(q, k_pages, v_pages)
    quantized = k_scales is not None
    if quantized != is_quantized(k_pages.dtype):
        raise ValueError(f"pages of {k_pages.dtype} {'need' if is_quantized(k_pages.dtype) else 'take no'} scales")
    group = h // kv
    gp = 1 << (group - 1).bit_length()  # Triton tensors need power-of-two dims: pad the head group
    block_q = _pick_block_q(gp) if block_q is None else block_q
    if not _is_pow2(block_q):
        raise ValueError(f"block_q {block_q} must be a power of two")
    if gp != group:
        q = jnp.pad(q.reshape(n, kv, group, d), ((0, 0), (0, 0), (0, gp - group), (0, 0))).reshape(n, kv * gp, d)
    num_blocks = n // block_q + page_table.shape[0]  # sum of ceil(q_len / block_q) never exceeds this
    blocks = _block_map(query_start, num_seqs, block_q, num_blocks)
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1).reshape(1)
    kernel = pl.pallas_call(
        lambda *refs: _kernel(*refs, block_q=block_q, group=gp, page=page, scale=sm_scale * _LOG2E,
                              quantized=quantized),
        grid=(num_blocks, kv),  # block index fastest: neighbouring programs share a kv head's pages in L2
        out_shape=(jax.ShapeDtypeStruct((n, kv * gp, d), out_dtype), jax.ShapeDtypeStruct((n, kv * gp), jnp.float32)),
        # 4 warps hold a <= 64x128 f32 accumulator comfortably, larger tiles get 8; two stages prefetch
        # the next page's K/V (page table lookup included) while this page is computed.
        compiler_params=plgpu.CompilerParams(num_warps=4 if block_q * gp * d <= 64 * 128 else 8, num_stages=2),
        interpret=interpret,
        name="ragged_paged_attention",
    )
    scales = (k_scales, v_scales) if quantized else ()
    out, lse = kernel(blocks, layer, page_table.astype(jnp.int32), visible.astype(jnp.int32), q, k_pages, v_pages,
                      *scales)
    out = out.reshape(n, kv, gp, d)[:, :, :group].reshape(n, h, d)
    valid = jnp.arange(n) < query_start[num_seqs]  # padding tokens belong to no block: their rows are unset
    lse = lse.reshape(n, kv, gp)[:, :, :group].reshape(n, h)
    return jnp.where(valid[:, None, None], out, 0), jnp.where(valid[:, None], lse, -jnp.inf)
