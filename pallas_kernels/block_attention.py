"""Block attention: a step's queries over a block of the same step's keys, with the log-sum-exp out.

What a rank of ring attention does with each K/V block passing by (jaxinfer/device/attention/ring.py): the
keys are not in pages yet, and a block holds chunks of several sequences in the ring's order, so which key
a query sees is decided per pair, not by a prefix of a page table:

    query t sees key j  iff  q_seq[t] >= 0 and k_seq[j] == q_seq[t] and k_pos[j] <= q_pos[t]

q [N, H, D]; k, v [M, KV, D] (query head h reads kv head h // (H / KV)); positions and sequence ids int32
(q_seq -1: padding). Result: float32 (out [N, H, D], lse [N, H]), 0 and -inf for a row that sees no key of
the block, so that partials over disjoint keys merge exactly (ragged_paged_attention.merge_partials).

Two implementations with one contract, and the C++ kernel for XLA:CPU (jaxinfer/device/attention/cpu.py):
- `block_attention_reference`: jax.numpy, taken QUERY_TILE queries by KEY_TILE keys at a time with a running
  merge, so its scores take O(QUERY_TILE x KEY_TILE) memory, never O(N x M);
- `block_attention`: a Pallas kernel lowered through Triton (flash attention with the pairwise mask above).
  Grid (query block, kv head); a program's rows are block_q tokens x the G query heads of its kv head, and
  it walks the block's keys block_k at a time with an online softmax, never holding more than one tile of
  scores.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas_kernels.ragged_paged_attention import merge_partials

QUERY_TILE = 512   # reference: queries attended together, each tile over all the key tiles
KEY_TILE = 512     # reference: keys per online-softmax update
BLOCK_K = 64       # kernel: keys per online-softmax update
_ROWS = 64         # kernel: rows (tokens x heads of a group) per program by default
_LOG2E = math.log2(math.e)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so a fully masked tile gives p = 0, not NaN


def check_shapes(q: jax.Array, q_pos: jax.Array, q_seq: jax.Array, k: jax.Array, v: jax.Array, k_pos: jax.Array,
                 k_seq: jax.Array) -> None:
    """The contract's shapes, or an error naming what disagrees."""
    chex.assert_rank([q, k, v], 3)
    chex.assert_equal_shape([k, v])
    chex.assert_shape([q_pos, q_seq], q.shape[:1])
    chex.assert_shape([k_pos, k_seq], k.shape[:1])
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {q.shape} does not fit keys {k.shape}: heads must be a multiple of kv heads, "
                         "head_dim equal")


def _dense(q, q_pos, q_seq, k, v, k_pos, k_seq, scale: float) -> tuple[jax.Array, jax.Array]:
    """The contract in one piece of [N, H, M] scores."""
    n, h, d = q.shape
    qg = q.reshape(n, k.shape[1], h // k.shape[1], d)
    s = jnp.einsum("nkgd,mkd->nkgm", qg, k, preferred_element_type=jnp.float32) * scale
    visible = (q_seq[:, None] == k_seq[None, :]) & (q_seq[:, None] >= 0) & (k_pos[None, :] <= q_pos[:, None])
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None])
    out = jnp.einsum("nkgm,mkd->nkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(n, h, d), lse.reshape(n, h)


def _key_tiles(q, q_pos, q_seq, k, v, k_pos, k_seq, scale: float) -> tuple[jax.Array, jax.Array]:
    """_dense's result, the keys taken KEY_TILE at a time with a running merge: [N, H, KEY_TILE] scores at most."""
    m = k.shape[0]
    if m <= KEY_TILE:
        return _dense(q, q_pos, q_seq, k, v, k_pos, k_seq, scale)
    pad, tiles = -m % KEY_TILE, -(-m // KEY_TILE)
    k, v = (jnp.pad(x, ((0, pad), (0, 0), (0, 0))) for x in (k, v))
    k_pos, k_seq = jnp.pad(k_pos, (0, pad)), jnp.pad(k_seq, (0, pad), constant_values=-1)   # seen by no query

    def tile(state, x):
        part = _dense(q, q_pos, q_seq, *x, scale)
        return merge_partials(jnp.stack([state[0], part[0]]), jnp.stack([state[1], part[1]])), None

    n, h, d = q.shape
    start = (jnp.zeros((n, h, d), jnp.float32), jnp.full((n, h), -jnp.inf, jnp.float32))
    tiled = (k.reshape(tiles, KEY_TILE, *k.shape[1:]), v.reshape(tiles, KEY_TILE, *v.shape[1:]),
             k_pos.reshape(tiles, KEY_TILE), k_seq.reshape(tiles, KEY_TILE))
    return lax.scan(tile, start, tiled)[0]


def block_attention_reference(q: jax.Array, q_pos: jax.Array, q_seq: jax.Array, k: jax.Array, v: jax.Array,
                              k_pos: jax.Array, k_seq: jax.Array, *, sm_scale: float) -> tuple[jax.Array, jax.Array]:
    """The contract in jax.numpy, QUERY_TILE queries x KEY_TILE keys at a time: float32 (out [N, H, D], lse [N, H])."""
    check_shapes(q, q_pos, q_seq, k, v, k_pos, k_seq)
    n = q.shape[0]
    if n <= QUERY_TILE:
        return _key_tiles(q, q_pos, q_seq, k, v, k_pos, k_seq, sm_scale)
    pad, tiles = -n % QUERY_TILE, -(-n // QUERY_TILE)
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    q_pos, q_seq = jnp.pad(q_pos, (0, pad)), jnp.pad(q_seq, (0, pad), constant_values=-1)   # see no key

    def tile(x):
        return _key_tiles(*x[:3], k, v, k_pos, k_seq, sm_scale)

    out, lse = lax.map(tile, (q.reshape(tiles, QUERY_TILE, *q.shape[1:]), q_pos.reshape(tiles, QUERY_TILE),
                              q_seq.reshape(tiles, QUERY_TILE)))
    return out.reshape(tiles * QUERY_TILE, *out.shape[2:])[:n], lse.reshape(tiles * QUERY_TILE, -1)[:n]


def _kernel(q_pos_ref, q_seq_ref, k_pos_ref, k_seq_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block_q: int,
            block_k: int, group: int, scale: float):
    """One (query block, kv head) program: block_q tokens x G heads as rows, an online softmax over the block's
    keys block_k at a time (scores in log2 units: `scale` includes log2(e)). A row that sees no key gets 0
    and -inf."""
    i, h = pl.program_id(0), pl.program_id(1)
    d = q_ref.shape[-1]
    rows = block_q * group
    tokens = pl.ds(i * block_q, block_q)
    q = q_ref[tokens, pl.ds(h * group, group), :].reshape(rows, d)
    row_pos = jnp.broadcast_to(q_pos_ref[tokens][:, None], (block_q, group)).reshape(rows)
    row_seq = jnp.broadcast_to(q_seq_ref[tokens][:, None], (block_q, group)).reshape(rows)

    def body(j, carry):
        acc, m, denom, seen = carry
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[h, keys, :], v_ref[h, keys, :]                       # [block_k, D] each
        visible = ((row_seq[:, None] == k_seq_ref[keys][None, :]) & (row_seq[:, None] >= 0)
                   & (k_pos_ref[keys][None, :] <= row_pos[:, None]))
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        s = jnp.where(visible, s, _MASK)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp2(s - m_new[:, None])
        corr = jnp.exp2(m - m_new)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        seen = jnp.maximum(seen, jnp.max(visible.astype(jnp.float32), axis=1))
        return acc * corr[:, None] + pv, m_new, denom * corr + p.sum(axis=1), seen

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.float32))
    tiles = jnp.where(jnp.max(row_seq) >= 0, k_ref.shape[1] // block_k, 0)   # a block of padding reads no key
    acc, m, denom, seen = lax.fori_loop(0, tiles, body, init)
    seen = seen > 0
    out = jnp.where(seen[:, None], acc / jnp.where(seen, denom, 1.0)[:, None], 0)
    o_ref[tokens, pl.ds(h * group, group), :] = out.reshape(block_q, group, d)
    lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, denom, 1.0))) / _LOG2E, -jnp.inf)
    lse_ref[tokens, pl.ds(h * group, group)] = lse.reshape(block_q, group)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def block_attention(q: jax.Array, q_pos: jax.Array, q_seq: jax.Array, k: jax.Array, v: jax.Array, k_pos: jax.Array,
                    k_seq: jax.Array, *, sm_scale: float, block_q: int | None = None, block_k: int = BLOCK_K,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Pallas (Triton) block attention; the contract of `block_attention_reference`.

    block_q: tokens per program (a power of two; None: 64 rows of tokens x heads); block_k: keys per tile (a
    power of two >= 16). The queries and keys are padded to whole blocks here (padding sees nothing)."""
    check_shapes(q, q_pos, q_seq, k, v, k_pos, k_seq)
    n, h, d = q.shape
    m, kv, _ = k.shape
    if not _pow2(d) or d < 16:
        raise ValueError(f"head_dim {d} must be a power of two >= 16 for the Triton kernel (dot K dimension)")
    if not _pow2(block_k) or block_k < 16:
        raise ValueError(f"block_k {block_k} must be a power of two >= 16")
    group = h // kv
    gp = 1 << (group - 1).bit_length()   # Triton tensors need power-of-two dims: pad the head group
    block_q = max(1, _ROWS // gp) if block_q is None else block_q
    if not _pow2(block_q):
        raise ValueError(f"block_q {block_q} must be a power of two")
    qn, km = -(-n // block_q) * block_q, -(-m // block_k) * block_k
    qg = jnp.pad(q.reshape(n, kv, group, d), ((0, qn - n), (0, 0), (0, gp - group), (0, 0))).reshape(qn, kv * gp, d)
    q_pos, q_seq = jnp.pad(q_pos, (0, qn - n)), jnp.pad(q_seq, (0, qn - n), constant_values=-1)
    k_pos, k_seq = jnp.pad(k_pos, (0, km - m)), jnp.pad(k_seq, (0, km - m), constant_values=-1)
    kt, vt = (jnp.pad(x, ((0, km - m), (0, 0), (0, 0))).transpose(1, 0, 2) for x in (k, v))   # [KV, M, D]
    out, lse = pl.pallas_call(
        lambda *refs: _kernel(*refs, block_q=block_q, block_k=block_k, group=gp, scale=sm_scale * _LOG2E),
        grid=(qn // block_q, kv),
        out_shape=(jax.ShapeDtypeStruct((qn, kv * gp, d), jnp.float32),
                   jax.ShapeDtypeStruct((qn, kv * gp), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=4 if block_q * gp * d <= 64 * 128 else 8, num_stages=2),
        interpret=interpret,
        name="block_attention",
    )(*(x.astype(jnp.int32) for x in (q_pos, q_seq, k_pos, k_seq)), qg, kt, vt)
    out = out.reshape(qn, kv, gp, d)[:n, :, :group].reshape(n, h, d)
    return out, lse.reshape(qn, kv, gp)[:n, :, :group].reshape(n, h)
