"""Block attention (pallas_kernels/block_attention.py), what a rank of ring attention does with each K/V block
passing by: the jnp reference, the Pallas kernel (interpret mode on CPU, compiled through Triton on a GPU)
and the C++ kernel against a dense numpy oracle on the ring's own block shapes, the reference's memory
bounded by its tiles, and the kernel cross-lowered for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.device.attention import cpu
from jaxinfer.pallas_kernels import block_attention as ba
from jaxinfer.step import ring_order

INTERPRET = jax.default_backend() != "gpu"   # JAX_PLATFORMS=cuda runs the kernel for real
pytestmark = pytest.mark.usefixtures("float32_dots_exact")

KERNELS = {"reference": ba.block_attention_reference,
           "pallas": functools.partial(ba.block_attention, interpret=INTERPRET),
           "cpu": cpu.block_attention}


def _has_cpu() -> bool:
    try:
        return bool(jax.devices("cpu"))
    except RuntimeError:                       # JAX_PLATFORMS=cuda: a GPU run of the kernel tests
        return False


# the C++ kernel runs on CPU devices (a GPU run of these tests has none)
KERNEL_PARAMS = [k if k != "cpu" else pytest.param(k, marks=pytest.mark.skipif(not _has_cpu(), reason="no CPU"))
                 for k in KERNELS]


def oracle(q, q_pos, q_seq, k, v, k_pos, k_seq, scale):
    """Dense attention in float64: (out, lse), 0 and -inf where a row sees no key."""
    n, h, d = q.shape
    g = h // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)                    # [M, H, D]
    s = np.einsum("nhd,mhd->nhm", q, kk) * scale
    visible = (q_seq[:, None] == k_seq[None, :]) & (q_seq[:, None] >= 0) & (k_pos[None, :] <= q_pos[:, None])
    s = np.where(visible[:, None, :], s, -np.inf)
    top = np.max(s, axis=-1, initial=-np.inf)
    safe = np.where(np.isfinite(top), top, 0)
    p = np.exp(s - safe[..., None])
    total = p.sum(-1)
    out = np.einsum("nhm,mhd->nhd", p, vv) / np.where(total > 0, total, 1)[..., None]
    return out, np.where(total > 0, np.log(np.where(total > 0, total, 1)) + safe, -np.inf)


def ring_row(seqs: list[tuple[int, int]], tokens: int, sp: int):
    """A step's row of (cached context, new tokens) sequences padded to `tokens`, in the ring's order:
    positions and sequence ids (-1: padding), and each rank's slice."""
    pos, seq = np.zeros(tokens, np.int32), np.full(tokens, -1, np.int32)
    at = 0
    for s, (before, new) in enumerate(seqs):
        pos[at: at + new], seq[at: at + new] = before + np.arange(new), s
        at += new
    order = ring_order(tokens, sp)
    n = tokens // sp
    return pos[order], seq[order], n


# (sequences as (context cached before, new tokens), step width, sp, heads, kv heads): ragged rows with
# padding, a chunk after cached context, GQA groups 2, 1 and 3 (padded to 4 in the Pallas kernel)
CASES = {
    "one_prompt_sp2": ([(0, 61)], 64, 2, 4, 2),
    "ragged_sp2": ([(0, 37), (0, 5), (40, 20)], 64, 2, 4, 4),
    "ragged_sp4": ([(0, 50), (100, 30), (0, 9)], 96, 4, 6, 2),
}


def blocks(name: str):
    """Every (query rank, key rank) pair of the case, as ring.py calls the kernel: its own block whole and
    causal; an earlier rank's block, first half of the keys, for all queries; a later rank's block, whole,
    for the second half of the queries (the chunk pairing's halves)."""
    seqs, tokens, sp, *_ = CASES[name]
    pos, seq, n = ring_row(seqs, tokens, sp)
    h = n // 2
    for r in range(sp):
        q_sl = slice(r * n, (r + 1) * n)
        for src in range(sp):
            k_sl = slice(src * n, (src + 1) * n)
            if src == r:
                yield q_sl, k_sl
            elif src < r:
                yield q_sl, slice(src * n, src * n + h)
            else:
                yield slice(r * n + h, (r + 1) * n), k_sl


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_attention_matches_dense_oracle(kernel: str, name: str, dtype: str, monkeypatch):
    """Every kernel on every ring block of the case equals dense attention (the reference with tiles of 16
    queries and 16 keys, so its tiling and running merge are exercised)."""
    monkeypatch.setattr(ba, "QUERY_TILE", 16)
    monkeypatch.setattr(ba, "KEY_TILE", 16)
    seqs, tokens, sp, heads, kv_heads = CASES[name]
    pos, seq, _ = ring_row(seqs, tokens, sp)
    rng = np.random.default_rng(0)
    d, scale = 16, 0.25
    q = rng.standard_normal((tokens, heads, d)).astype(dtype)
    k, v = (rng.standard_normal((tokens, kv_heads, d)).astype(dtype) for _ in range(2))
    fn = jax.jit(functools.partial(KERNELS[kernel], sm_scale=scale))
    for q_sl, k_sl in blocks(name):
        args = (q[q_sl], pos[q_sl], seq[q_sl], k[k_sl], v[k_sl], pos[k_sl], seq[k_sl])
        out, lse = fn(*map(jnp.asarray, args))
        want, want_lse = oracle(*(np.asarray(x, np.float64) if x.dtype != np.int32 else x for x in args), scale)
        tol = 1e-5 if dtype == "float32" else 2e-2
        np.testing.assert_allclose(np.asarray(out), want, atol=tol, rtol=0)
        np.testing.assert_allclose(np.asarray(lse), want_lse, atol=tol, rtol=tol)
        assert out.dtype == lse.dtype == jnp.float32


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_a_block_no_query_sees_gives_zeros_and_minus_infinity(kernel: str):
    q, k = jnp.ones((8, 2, 16)), jnp.ones((24, 1, 16))
    later = jnp.arange(24, dtype=jnp.int32) + 100                     # keys after every query
    out, lse = KERNELS[kernel](q, jnp.arange(8), jnp.zeros(8, jnp.int32), k, k, later, jnp.zeros(24, jnp.int32),
                               sm_scale=0.25)
    assert not np.asarray(out).any() and np.isneginf(np.asarray(lse)).all()


def test_the_reference_holds_a_tile_of_scores_not_the_blocks(monkeypatch):
    """1024 queries over 1024 keys in tiles of 128 x 128: the compiled reference's temporaries stay within a
    few tiles of scores (256 KiB each), far below one block's N x H x M (16 MiB)."""
    monkeypatch.setattr(ba, "QUERY_TILE", 128)
    monkeypatch.setattr(ba, "KEY_TILE", 128)
    n, h, d = 1024, 4, 16
    sds = jax.ShapeDtypeStruct
    args = (sds((n, h, d), jnp.float32), sds((n,), jnp.int32), sds((n,), jnp.int32), sds((n, 2, d), jnp.float32),
            sds((n, 2, d), jnp.float32), sds((n,), jnp.int32), sds((n,), jnp.int32))
    f = jax.jit(functools.partial(ba.block_attention_reference, sm_scale=0.25))
    temp = f.lower(*args).compile().memory_analysis().temp_size_in_bytes
    tile = ba.QUERY_TILE * h * ba.KEY_TILE * 4
    assert temp < 4 * tile < n * h * n * 4


def test_refuses_shapes_the_kernel_cannot_tile():
    q, pos = jnp.ones((8, 2, 8)), jnp.arange(8, dtype=jnp.int32)
    with pytest.raises(ValueError, match="head_dim 8"):
        ba.block_attention(q, pos, pos, q, q, pos, pos, sm_scale=0.1)
    q = jnp.ones((8, 2, 16))
    with pytest.raises(ValueError, match="block_k 8"):
        ba.block_attention(q, pos, pos, q, q, pos, pos, sm_scale=0.1, block_k=8)
    with pytest.raises(ValueError, match="heads must be a multiple"):
        ba.block_attention_reference(q, pos, pos, jnp.ones((8, 3, 16)), jnp.ones((8, 3, 16)), pos, pos, sm_scale=0.1)


H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


@pytest.mark.parametrize("heads", [32, 56])
def test_lowers_for_cuda(heads: int):
    """A 2k-token rank's chunk pair over a passing block at Llama-3-8B's heads (GQA 4, and 7 padded to 8)."""
    sds = jax.ShapeDtypeStruct
    n, ints = 2048, sds((2048,), jnp.int32)
    q, kv = sds((n, heads, 128), jnp.bfloat16), sds((n, 8, 128), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H100)):
        text = (jax.jit(functools.partial(ba.block_attention, sm_scale=0.088)).trace(q, ints, ints, kv, kv, ints, ints)
                .lower(lowering_platforms=("cuda",)).as_text())
    assert "__gpu$xla.gpu.triton" in text
