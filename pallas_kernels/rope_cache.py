"""Fused rotary embedding + paged KV-cache write: one read of q/k/v, one write of q_rot and the k/v rows.

Runs on one device's local arrays (the engine wraps it in shard_map; heads are local heads).

Shapes: q [N, H, D]; k, v [N, KV, D]; k_pages, v_pages [L, KV, num_pages, P, D]; positions, slots int32 [N];
inv_freq float32 [D/2]; layer an int32 scalar (may be traced). Token n's k/v go to layer `layer`, flat slot
slots[n] = page * P + offset; a slot outside [0, num_pages * P) (padding uses num_pages * P) writes nothing.
Real slots must be distinct within a call (which duplicate wins is unspecified, as in an XLA scatter).

RoPE is Hugging Face "rotate half". Rounding, the same code in reference and kernel: angle =
f32(position) * inv_freq (f32), c = cos(angle), s = sin(angle), x1, x2 = the halves of x.astype(f32);
out = concat([x1 * c - x2 * s, x2 * c + x1 * s]) in f32 (a + (-b) == a - b exactly, so this is HF's
x * cos + rotate_half(x) * sin), cast once (round to nearest even) to x's dtype. Each product is rounded to
f32 before the sum, except that compilers may contract one product and the sum into an FMA (XLA:CPU fusions
and Triton do): within 1 ulp in f32. The jitted reference and the interpreted kernel agree bit for bit.
Rotated k is cast to k's dtype and then to the pool dtype (as "rope, then write" does); v to the pool dtype.

Quantized pages (int8 or float8_e4m3fn pools, with k_scales and v_scales [L, KV, num_pages, P, 1] bfloat16):
rotated k (in k's dtype) and v are quantized as they are written, one scale per token and KV head
(pallas_kernels/kv_quant.py): the kernel takes the amax over both halves of the vector it holds in
registers, so quantizing costs no extra pass over memory; the scale is stored at [block_tokens, 1] pointers
beside the rows. Reference and kernel use kv_quant's functions, so their pages agree bit for bit.

The pools are whole-array refs (no BlockSpec), aliased input -> output: Triton hands the kernel raw global
pointers, so nothing is staged through shared memory and the pool is never copied; each program writes its
[block_tokens, D/2] rows with one masked scatter store at pointers (layer, kv_head, slot // P, slot % P, d).
`memory_space=pl.ANY` on every operand lowers too (Triton has no other place to put them); per-token stores lower but
issue block_tokens narrow stores instead of one. Index arrays only (no pl.ds next to them): interpret mode
refuses mixing slices with array indices. The Triton lowering needs power-of-two sizes for every load/store
(D/2 and block_tokens), and same-rank masks (a [BT] mask against [BT, D/2] lanes is refused).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas_kernels.kv_quant import is_quantized, quantize, quantize_with, scale_of


def _rotate(x1: jax.Array, x2: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The two halves of the rotated vector, in float32."""
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [N, heads, D], cos/sin [N, 1, D/2] -> rotated x in x's dtype."""
    half = x.shape[-1] // 2
    lo, hi = _rotate(x[..., :half], x[..., half:], cos, sin)
    return jnp.concatenate([lo, hi], axis=-1).astype(x.dtype)


def cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles, [N, D/2] each in float32."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding of x [N, heads, D] at `positions` [N], in x's dtype (computed in float32)."""
    cos, sin = cos_sin(positions, inv_freq)
    return _rope(x, cos[:, None, :], sin[:, None, :])


def scatter_rows(pool: jax.Array, layer: jax.Array | int, x: jax.Array, slots: jax.Array) -> jax.Array:
    """x [N, KV, D'] into its slots of one layer of `pool` [L, KV, pages, P, D'], as they are (one scatter,
    mode="drop": a slot outside the pool writes nothing), so a donated pool is updated in place."""
    num_pages, page_size = pool.shape[2], pool.shape[3]
    valid = (slots >= 0) & (slots < num_pages * page_size)
    page = jnp.where(valid, slots // page_size, num_pages)[:, None]       # [N, 1]; num_pages is dropped
    offset = (slots % page_size)[:, None]
    heads = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]               # [1, KV]
    return pool.at[layer, heads, page, offset].set(x.astype(pool.dtype), mode="drop")   # broadcasts to [N, KV]


def write_pages(k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array | int, k: jax.Array, v: jax.Array,
                slots: jax.Array, *, k_scales: jax.Array | None = None,
                v_scales: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """k, v [N, KV, D] into their slots of one layer -> (k_pages, v_pages). With scales (quantized pages,
    pallas_kernels/kv_quant.py), each vector is quantized to the pool's dtype first and its scale written
    beside it -> (k_pages, v_pages, k_scales, v_scales)."""
    if k_scales is None:
        return scatter_rows(k_pages, layer, k, slots), scatter_rows(v_pages, layer, v, slots)
    (kq, ks), (vq, vs) = quantize(k, k_pages.dtype), quantize(v, v_pages.dtype)
    return (scatter_rows(k_pages, layer, kq, slots), scatter_rows(v_pages, layer, vq, slots),
            scatter_rows(k_scales, layer, ks, slots), scatter_rows(v_scales, layer, vs, slots))


def rope_and_write_reference(q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                             layer: jax.Array | int, positions: jax.Array, slots: jax.Array,
                             inv_freq: jax.Array, *, k_scales: jax.Array | None = None,
                             v_scales: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Pure jax.numpy: RoPE, then the K/V write -> (q_rot, k_pages, v_pages), and the scales with them for
    quantized pages (write_pages)."""
    chex.assert_rank([q, k, v, k_pages, v_pages, positions, slots], [3, 3, 3, 5, 5, 1, 1])
    chex.assert_equal_shape([k, v])
    chex.assert_equal_shape([k_pages, v_pages])
    chex.assert_equal_shape([positions, slots])
    pools = write_pages(k_pages, v_pages, layer, rope(k, positions, inv_freq), v, slots, k_scales=k_scales,
                        v_scales=v_scales)
    return rope(q, positions, inv_freq), *pools


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
           positions: jax.Array, slots: jax.Array, inv_freq: jax.Array, block_tokens: int) -> None:
    """Refuse, before lowering, what the kernel cannot serve (Triton tensors must have power-of-two sizes)."""
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or k_pages.ndim != 5 or k_pages.shape != v_pages.shape:
        raise ValueError(f"want q [N,H,D], k=v [N,KV,D], pools [L,KV,pages,P,D]; got {q.shape}, {k.shape}, "
                         f"{v.shape}, {k_pages.shape}, {v_pages.shape}")
    (N, H, D), KV = q.shape, k.shape[1]
    if k.shape[0] != N or k.shape[2] != D or k_pages.shape[1] != KV or k_pages.shape[4] != D:
        raise ValueError(f"inconsistent shapes: q {q.shape}, k {k.shape}, pools {k_pages.shape}")
    if H % KV:
        raise ValueError(f"query heads {H} not a multiple of kv heads {KV}")
    if D % 2 or not _is_pow2(D // 2):
        raise ValueError(f"head_dim {D} unsupported by the Triton kernel: D/2 must be a power of two "
                         "(use rope_and_write_reference)")
    if not _is_pow2(block_tokens):
        raise ValueError(f"block_tokens {block_tokens} must be a power of two")
    if positions.shape != (N,) or slots.shape != (N,) or inv_freq.shape != (D // 2,):
        raise ValueError(f"want positions, slots [{N}] and inv_freq [{D // 2}]; got {positions.shape}, "
                         f"{slots.shape}, {inv_freq.shape}")


def _round_ptx(y: jax.Array) -> jax.Array:
    """Round half to even in the Triton kernel, whose lowering has no jnp.round: PTX cvt.rni on each float32."""
    (out,) = plgpu.elementwise_inline_asm("cvt.rni.f32.f32 $0, $1;", args=[y], constraints="=f,f", pack=1,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, y.dtype)])
    return out


def _kernel(layer_ref, pos_ref, slot_ref, freq_ref, q_ref, k_ref, v_ref, *refs, block_tokens: int, group: int,
            quantized: bool, interpret: bool) -> None:
    """Program (i, g): tokens [i*BT, i*BT+BT) of kv head g and its `group` query heads. refs: the pools as
    inputs (aliased, unread), then q_out and the pools as outputs; quantized pages have their scales after
    each pool group."""
    n_pools = 4 if quantized else 2
    q_out, k_pool, v_pool, *scales = refs[n_pools:]
    k_scale, v_scale = scales if quantized else (None, None)
    bt, g = block_tokens, pl.program_id(1)
    n_tok, half = q_ref.shape[0], q_ref.shape[2] // 2
    num_pages, page_size = k_pool.shape[2], k_pool.shape[3]
    rows = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    tok = pl.ds(pl.program_id(0) * bt, bt)
    in_n = (rows < n_tok)[:, None]                                         # [BT, 1]
    pos = plgpu.load(pos_ref.at[tok], mask=rows < n_tok, other=0)
    slot = plgpu.load(slot_ref.at[tok], mask=rows < n_tok, other=num_pages * page_size)
    angles = pos.astype(jnp.float32)[:, None] * freq_ref[...].astype(jnp.float32)[None, :]    # [BT, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    lo_cols, hi_cols = pl.ds(0, half), pl.ds(half, half)

    def rotate_head(ref, head):
        x1 = plgpu.load(ref.at[tok, head, lo_cols], mask=in_n, other=0)
        x2 = plgpu.load(ref.at[tok, head, hi_cols], mask=in_n, other=0)
        return _rotate(x1, x2, cos, sin)

    for j in range(group):                                                 # static: the query heads of g
        head = g * group + j
        lo, hi = rotate_head(q_ref, head)
        plgpu.store(q_out.at[tok, head, lo_cols], lo.astype(q_out.dtype), mask=in_n)
        plgpu.store(q_out.at[tok, head, hi_cols], hi.astype(q_out.dtype), mask=in_n)

    # The pool stays a whole-array ref in global memory: a scatter store at [BT, D/2] pointers
    # (layer, g, page[t], offset[t], d), masked per token, so padding and tail tokens write nothing.
    ok = ((slot >= 0) & (slot < num_pages * page_size))[:, None] & in_n
    page, offset = (slot // page_size)[:, None], (slot % page_size)[:, None]
    layer = layer_ref[0]
    cols = jnp.arange(half, dtype=jnp.int32)[None, :]

    def store(pool, scale_pool, lo, hi):
        """A vector's halves [BT, D/2] (float32 holding values of the model's dtype) into their rows; quantized:
        the amax over both halves gives the scale (kv_quant), stored at [BT, 1] pointers beside the page."""
        if scale_pool is not None:
            amax = jnp.maximum(jnp.abs(lo).max(axis=1, keepdims=True), jnp.abs(hi).max(axis=1, keepdims=True))
            scale = scale_of(amax, pool.dtype)                             # [BT, 1]
            rne = jnp.round if interpret else _round_ptx
            lo, hi = (quantize_with(part, scale, pool.dtype, rne) for part in (lo, hi))
            plgpu.store(scale_pool.at[layer, g, page, offset, jnp.zeros((1, 1), jnp.int32)], scale, mask=ok)
        for part, start in ((lo, 0), (hi, half)):
            plgpu.store(pool.at[layer, g, page, offset, cols + start], part.astype(pool.dtype), mask=ok)

    lo, hi = rotate_head(k_ref, g)
    store(k_pool, k_scale, lo.astype(k_ref.dtype).astype(jnp.float32), hi.astype(k_ref.dtype).astype(jnp.float32))
    v_lo, v_hi = (plgpu.load(v_ref.at[tok, g, cols_], mask=in_n, other=0).astype(jnp.float32)
                  for cols_ in (lo_cols, hi_cols))
    store(v_pool, v_scale, v_lo, v_hi)


@functools.partial(jax.jit, static_argnames=("block_tokens", "interpret"))
def rope_and_write(q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                   layer: jax.Array | int, positions: jax.Array, slots: jax.Array, inv_freq: jax.Array, *,
                   k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                   block_tokens: int = 16, interpret: bool = False) -> tuple[jax.Array, ...]:
    """Pallas (Triton lowering) version of rope_and_write_reference; the pools (and scales) are aliased to the
    outputs."""
    _check(q, k, v, k_pages, v_pages, positions, slots, inv_freq, block_tokens)
    quantized = k_scales is not None
    if quantized != is_quantized(k_pages.dtype):
        raise ValueError(f"pages of {k_pages.dtype} {'need' if is_quantized(k_pages.dtype) else 'take no'} scales")
    N, H, D = q.shape
    KV = k.shape[1]
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    pools = (k_pages, v_pages, k_scales, v_scales) if quantized else (k_pages, v_pages)
    kernel = functools.partial(_kernel, block_tokens=block_tokens, group=H // KV, quantized=quantized,
                               interpret=interpret)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, block_tokens), KV),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools)),
        input_output_aliases={7 + i: 1 + i for i in range(len(pools))},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rope_and_write",
    )(layer_arr, positions.astype(jnp.int32), slots.astype(jnp.int32), inv_freq.astype(jnp.float32), q, k, v,
      *pools)
