"""Ragged paged attention: the jnp reference against a dense per-sequence attention, the Pallas kernel
against the reference (compiled through Triton on a GPU, interpret mode elsewhere), the C++ kernel for
XLA:CPU against the reference, and the Pallas kernel cross-lowered for CUDA on an abstract H100."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.device.attention import choose_backend, cpu
from jaxinfer.pallas_kernels.ragged_paged_attention import (
    merge_partials,
    paged_attention_partial,
    ragged_paged_attention,
    ragged_paged_attention_partial,
    ragged_paged_attention_reference,
    together_pays,
)
from jaxinfer.pallas_kernels.rope_cache import rope_and_write_reference

INTERPRET = jax.default_backend() != "gpu"   # JAX_PLATFORMS=cuda runs the kernel for real
pytestmark = pytest.mark.usefixtures("float32_dots_exact")


@dataclasses.dataclass
class Case:
    """A step: (q_len, seq_len) per real sequence, padded to `tokens` tokens and `slots` sequence slots."""

    seqs: list[tuple[int, int]]
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int
    slots: int
    layers: int = 2
    layer: int = 1
    page: int = 16
    num_pages: int = 48
    max_pages: int = 20
    shared: int = 0  # sequence 1 reuses sequence 0's first `shared` pages (a shared prompt prefix)
    dtype: str = "float32"
    block_q: int | None = None


def make_inputs(c: Case, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(c.dtype)
    pool = (c.layers, c.kv_heads, c.num_pages, c.page, c.head_dim)
    q = rng.standard_normal((c.tokens, c.heads, c.head_dim))
    k, v = rng.standard_normal(pool), rng.standard_normal(pool)
    # Unused table entries are arbitrary: the sentinel one past the pool (padding slots), or page 0.
    page_table = np.where(rng.random((c.slots, c.max_pages)) < 0.5, c.num_pages, 0).astype(np.int32)
    free = iter(rng.permutation(c.num_pages))
    for s, (_, seq_len) in enumerate(c.seqs):
        n = -(-seq_len // c.page)
        page_table[s, :n] = [next(free) for _ in range(n)]
    if c.shared:
        page_table[1, :c.shared] = page_table[0, :c.shared]
    q_lens = [ql for ql, _ in c.seqs] + [0] * (c.slots - len(c.seqs))
    seq_lens = [sl for _, sl in c.seqs] + [0] * (c.slots - len(c.seqs))
    return dict(q=jnp.asarray(q, dt), k_pages=jnp.asarray(k, dt), v_pages=jnp.asarray(v, dt),
                layer=jnp.int32(c.layer), page_table=jnp.asarray(page_table),
                seq_lens=jnp.asarray(seq_lens, jnp.int32),
                query_start=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                num_seqs=jnp.int32(len(c.seqs)))


def dense_attention(inp: dict, sm_scale: float, with_lse: bool = False):
    """Per sequence: gather its pages into contiguous K/V, plain causal softmax at its offset (float64);
    with_lse: also each row's log-sum-exp of its scaled scores [N, H] (-inf for padding)."""
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    q, k_pages, v_pages = f64(inp["q"]), f64(inp["k_pages"]), f64(inp["v_pages"])
    k_layer, v_layer = k_pages[int(inp["layer"])], v_pages[int(inp["layer"])]
    kv, _, page, d = k_layer.shape
    group = q.shape[1] // kv
    qs, seq_lens, table = np.asarray(inp["query_start"]), np.asarray(inp["seq_lens"]), np.asarray(inp["page_table"])
    out = np.zeros_like(q)
    lse = np.full(q.shape[:2], -np.inf)
    for s in range(int(inp["num_seqs"])):
        lo, hi, seq_len = qs[s], qs[s + 1], seq_lens[s]
        pages = table[s, :-(-seq_len // page)]
        k = k_layer[:, pages].reshape(kv, -1, d)[:, :seq_len]        # [KV, seq_len, D]
        v = v_layer[:, pages].reshape(kv, -1, d)[:, :seq_len]
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # [H, seq_len, D]
        scores = np.einsum("thd,hsd->hts", q[lo:hi], k) * sm_scale
        q_pos = seq_len - (hi - lo) + np.arange(hi - lo)
        scores = np.where(np.arange(seq_len)[None, None, :] <= q_pos[None, :, None], scores, -np.inf)
        top = scores.max(-1, keepdims=True)
        w = np.exp(scores - top)
        out[lo:hi] = np.einsum("hts,hsd->thd", w / w.sum(-1, keepdims=True), v)
        lse[lo:hi] = (top[..., 0] + np.log(w.sum(-1))).T
    return (out, lse) if with_lse else out


ARGS = ("q", "k_pages", "v_pages", "layer", "page_table", "seq_lens", "query_start", "num_seqs")


def run_reference(inp: dict, sm_scale: float, return_lse: bool = False):
    f = functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale, return_lse=return_lse)
    return jax.jit(f)(*(inp[a] for a in ARGS))


def run_kernel(inp: dict, sm_scale: float, block_q: int | None, return_lse: bool = False):
    f = functools.partial(ragged_paged_attention, sm_scale=sm_scale, block_q=block_q, interpret=INTERPRET,
                          return_lse=return_lse)
    return jax.jit(f)(*(inp[a] for a in ARGS))


CASES = {
    # GQA 4: lengths 1, 15, 16, 17; a decode over 300 tokens; a 128-token chunk after 172 tokens of
    # context and a 20-token chunk starting mid-page; 10 padding tokens, 2 padding sequence slots.
    "gqa4_mixed": Case([(1, 1), (15, 15), (16, 16), (17, 17), (1, 300), (128, 300), (20, 37)],
                       heads=8, kv_heads=2, head_dim=32, tokens=208, slots=9, num_pages=64),
    # Same step through larger blocks (8 tokens x 4 heads = 32 rows).
    "gqa4_block8": Case([(1, 1), (15, 15), (17, 17), (1, 300), (20, 37)],
                        heads=8, kv_heads=2, head_dim=32, tokens=64, slots=6, num_pages=64, block_q=8),
    # MHA: a whole 300-token prefill; a decode sharing its first page; layer 0 of 3.
    "mha_prefill300_shared": Case([(300, 300), (1, 17), (5, 16)], heads=2, kv_heads=2, head_dim=16,
                                  tokens=320, slots=4, layers=3, layer=0, num_pages=32, shared=1),
    # GQA 8: decodes and chunks that share two prefix pages; last layer of 3.
    "gqa8_shared": Case([(3, 40), (1, 45), (1, 16), (9, 9), (33, 70)], heads=16, kv_heads=2, head_dim=16,
                        tokens=56, slots=6, layers=3, layer=2, num_pages=24, shared=2),
    # A head group of 3 (padded to 4 inside the kernel).
    "gqa3": Case([(1, 33), (7, 18)], heads=6, kv_heads=2, head_dim=16, tokens=16, slots=2, num_pages=8),
    # Long next to short: a decode at 1,100 tokens (69 pages: several page blocks of the reference, the last
    # one partial), short decodes, a 40-token chunk after 560 tokens of context (two query windows, the
    # second running into the next sequence's tokens), a 3-token prompt, a 37-token prompt before 12
    # padding tokens; a 128-entry page table (the engine's power-of-two bucket), pages scattered.
    "long_mixed": Case([(1, 1100), (1, 5), (40, 600), (1, 17), (3, 3), (1, 64), (37, 37)], heads=4, kv_heads=2,
                       head_dim=16, tokens=96, slots=8, num_pages=128, max_pages=128),
    # No more tokens than sequence slots (a decode step's shape: one token per window), a 2-token sequence
    # among the decodes, a decode over 38 pages (two blocks).
    "decode_shape": Case([(1, 40), (2, 18), (1, 1), (1, 600)], heads=4, kv_heads=2, head_dim=16, tokens=6, slots=8,
                         num_pages=64, max_pages=64),
    # The same shape with sequences of similar length: all tokens at once, not sequence by sequence
    # (together_pays); a 2-token sequence among them, pages scattered over the pool.
    "decode_even": Case([(1, 40), (1, 47), (2, 33), (1, 50), (1, 36)], heads=8, kv_heads=2, head_dim=16, tokens=8,
                        slots=8, num_pages=48, max_pages=8),
    # One sequence slot (a lone prompt's shape): a 40-token chunk after 60 tokens, two windows of 32.
    "one_slot": Case([(40, 100)], heads=4, kv_heads=1, head_dim=16, tokens=48, slots=1, num_pages=16, max_pages=8),
    "gqa4_bf16": Case([(1, 1), (17, 17), (1, 100), (20, 37)], heads=8, kv_heads=2, head_dim=64, tokens=48,
                      slots=5, num_pages=24, dtype="bfloat16"),
    "gqa8_bf16": Case([(1, 50), (12, 12), (1, 16)], heads=16, kv_heads=2, head_dim=32, tokens=16, slots=4,
                      num_pages=12, dtype="bfloat16"),
}


@pytest.mark.parametrize("name", CASES)
def test_reference_and_kernel(name: str):
    c = CASES[name]
    inp = make_inputs(c)
    scale = c.head_dim ** -0.5
    tol = dict(atol=1e-5, rtol=1e-5) if c.dtype == "float32" else dict(atol=3e-2, rtol=3e-2)
    dense = dense_attention(inp, scale)
    ref = run_reference(inp, scale)
    assert ref.shape == inp["q"].shape and ref.dtype == inp["q"].dtype
    np.testing.assert_allclose(np.asarray(ref, np.float64), dense, **tol)
    real = int(inp["query_start"][int(inp["num_seqs"])])
    assert real < c.tokens and not np.any(np.asarray(ref[real:], np.float32))  # padding tokens -> 0
    out = run_kernel(inp, scale, c.block_q)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(ref, np.float64), **tol)
    assert not np.any(np.asarray(out[real:], np.float32))


def test_decode_steps_batch_sequences_of_similar_length():
    pages = lambda c: [-(-seq_len // c.page) for _, seq_len in c.seqs]  # noqa: E731
    for name, batched in (("decode_even", True), ("decode_shape", False)):
        needed = np.asarray(pages(CASES[name]) + [0, 0])                # padding slots need none
        assert bool(together_pays(needed, len(CASES[name].seqs))) is batched, name


# long_mixed and decode_even: their log-sum-exps in test_partials_over_strided_pages_merge_to_whole
@pytest.mark.parametrize("name", ["gqa4_mixed", "gqa3", "gqa8_bf16"])
def test_log_sum_exp(name: str):
    """return_lse: the same output, and each row's log-sum-exp (what merging partial attention needs)."""
    c = CASES[name]
    inp = make_inputs(c, seed=1)
    scale = c.head_dim ** -0.5
    tol = dict(atol=1e-5, rtol=1e-5) if c.dtype == "float32" else dict(atol=3e-2, rtol=3e-2)
    dense, dense_lse = dense_attention(inp, scale, with_lse=True)
    real = int(inp["query_start"][int(inp["num_seqs"])])
    for out, lse in (run_reference(inp, scale, return_lse=True), run_kernel(inp, scale, c.block_q, return_lse=True)):
        assert lse.shape == inp["q"].shape[:2] and lse.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out, np.float64), dense, **tol)
        np.testing.assert_allclose(np.asarray(lse[:real], np.float64), dense_lse[:real], **tol)
        assert np.all(np.isneginf(np.asarray(lse[real:])))
    np.testing.assert_array_equal(np.asarray(run_reference(inp, scale, return_lse=True)[0]),
                                  np.asarray(run_reference(inp, scale)))


def test_only_padding_gives_zeros():
    inp = make_inputs(Case([(4, 20)], heads=4, kv_heads=1, head_dim=16, tokens=16, slots=2, num_pages=4))
    inp["num_seqs"] = jnp.int32(0)
    inp["query_start"] = jnp.zeros_like(inp["query_start"])
    assert not np.any(np.asarray(run_reference(inp, 0.25)))
    assert not np.any(np.asarray(run_kernel(inp, 0.25, None)))
    if cpu_devices():
        assert not np.any(np.asarray(run_cpu_kernel(inp, 0.25)))


# ---- the C++ kernel for XLA:CPU (the "cpu" backend, compiled on first use)

def cpu_devices() -> list:
    try:
        return jax.devices("cpu")
    except RuntimeError:                       # JAX_PLATFORMS=cuda: a GPU run of the kernel tests
        return []


on_cpu = pytest.mark.skipif(not cpu_devices(), reason="the C++ kernel runs on CPU devices; JAX_PLATFORMS has none")


def run_cpu_kernel(inp: dict, sm_scale: float):
    f = functools.partial(cpu.ragged_paged_attention, sm_scale=sm_scale)
    return jax.jit(f)(*jax.device_put([inp[a] for a in ARGS], cpu_devices()[0]))


# ---- partial attention over a rank's pages (sequence parallel): every kernel against the reference

PARTIALS = {"reference": paged_attention_partial,
            "pallas": functools.partial(ragged_paged_attention_partial, interpret=INTERPRET),
            "cpu": cpu.paged_attention_partial}


@pytest.mark.parametrize("kernel,name,stride", [
    ("reference", "long_mixed", 2), ("reference", "decode_even", 4), ("pallas", "long_mixed", 2),
    ("pallas", "gqa4_mixed", 4), pytest.param("cpu", "long_mixed", 2, marks=on_cpu),
    pytest.param("cpu", "gqa4_mixed", 4, marks=on_cpu), pytest.param("cpu", "page8", 3, marks=on_cpu)])
def test_partials_over_strided_pages_merge_to_whole(kernel: str, name: str, stride: int):
    """As the ranks of sp read them: every stride-th page of each sequence (page_stride, page_offset = rank).
    Causal limits: the ranks' partials merged by their log-sum-exps equal attention over all pages. A
    prefill chunk's limits (the context cached before it: none for a fresh sequence): each partial equals
    the reference's, 0 and -inf where a token sees no key."""
    c = CASES.get(name) or dataclasses.replace(CASES["gqa4_mixed"], page=8, num_pages=128, max_pages=42)
    inp = make_inputs(c, seed=2)
    scale = c.head_dim ** -0.5
    qs, seq_lens = np.asarray(inp["query_start"]), np.asarray(inp["seq_lens"])
    causal, before = np.zeros(c.tokens, np.int32), np.zeros(c.tokens, np.int32)   # 0 for padding
    for s in range(len(c.seqs)):
        q_len = qs[s + 1] - qs[s]
        causal[qs[s]: qs[s + 1]] = seq_lens[s] - q_len + np.arange(q_len) + 1
        before[qs[s]: qs[s + 1]] = seq_lens[s] - q_len
    width = -(-c.max_pages // stride) * stride
    table = np.pad(np.asarray(inp["page_table"]), ((0, 0), (0, width - c.max_pages))).reshape(c.slots, -1, stride)
    device = cpu_devices()[0] if kernel == "cpu" else None

    def partial(limit, r, fn=PARTIALS[kernel]):
        f = jax.jit(functools.partial(fn, sm_scale=scale, page_stride=stride))
        args = (inp["q"], inp["query_start"], inp["num_seqs"], jnp.asarray(limit), inp["k_pages"], inp["v_pages"],
                inp["layer"], jnp.asarray(table[:, :, r]), jnp.int32(r))
        *args, rank = jax.device_put(args, device) if device else args
        return f(*args, page_offset=rank)

    parts = [partial(causal, r) for r in range(stride)]
    out, lse = merge_partials(jnp.stack([o for o, _ in parts]), jnp.stack([x for _, x in parts]))
    dense, dense_lse = dense_attention(inp, scale, with_lse=True)
    real = int(qs[len(c.seqs)])
    np.testing.assert_allclose(np.asarray(out, np.float64), dense, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse[:real], np.float64), dense_lse[:real], atol=1e-5, rtol=1e-5)
    assert np.all(np.isneginf(np.asarray(lse[real:])))
    for r in range(stride):
        (got, got_lse), (want, want_lse) = partial(before, r), partial(before, r, paged_attention_partial)
        assert got.dtype == got_lse.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(np.isneginf(np.asarray(got_lse)), np.isneginf(np.asarray(want_lse)))
        np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=1e-5, rtol=1e-5)


@on_cpu
@pytest.mark.parametrize("name", [*CASES, "gqa4_mixed_f16", "gqa3_hd20", "gqa4_mixed_hd24", "gqa4_mixed_hd48",
                                  "gqa4_mixed_hd80", "gqa4_mixed_page8"])
def test_cpu_kernel_matches_reference(name: str):
    """Every case's ragged mix (decodes, chunks, shared prefixes, long next to short, padding) gives the
    reference's output; unused table entries, however wild, are never read. Also float16; head_dims that are
    not a multiple of 16 (24: plain loops where a register holds 16 lanes) or of 8 (20, with a decode's head
    group of 3: the plain scores and weighted sum on any target); head_dims of three and of five times 16;
    pages of 8, half a tile of keys."""
    extra = {"gqa4_mixed_f16": dict(dtype="float16"), "gqa3_hd20": dict(head_dim=20),
             "gqa4_mixed_hd24": dict(head_dim=24),
             "gqa4_mixed_hd48": dict(head_dim=48), "gqa4_mixed_hd80": dict(head_dim=80),
             "gqa4_mixed_page8": dict(page=8, num_pages=128, max_pages=40)}
    c = CASES.get(name) or dataclasses.replace(CASES[name.rsplit("_", 1)[0]], **extra[name])
    inp = make_inputs(c, seed=3)
    scale = c.head_dim ** -0.5
    tol = dict(atol=1e-5, rtol=1e-5) if c.dtype == "float32" else dict(atol=3e-2, rtol=3e-2)
    ref = run_reference(inp, scale)
    out = run_cpu_kernel(inp, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(ref, np.float64), **tol)
    table, lens = np.asarray(inp["page_table"]), np.asarray(inp["seq_lens"])
    unused = np.arange(table.shape[1])[None, :] >= -(-lens[:, None] // c.page)
    wild = np.where(np.random.default_rng(0).random(table.shape) < 0.5, -7, 1 << 30).astype(np.int32)
    out_wild = run_cpu_kernel({**inp, "page_table": jnp.asarray(np.where(unused, wild, table))}, scale)
    np.testing.assert_array_equal(np.asarray(out_wild, np.float32), np.asarray(out, np.float32))


def step_tokens(inp: dict, c: Case, rng: np.random.Generator) -> dict:
    """The step's new k and v [N, KV, D] (unrotated), each token's position and flat cache slot (padding
    tokens: position 0 and the slot past the pool), and the model's inv_freq."""
    dt = jnp.dtype(c.dtype)
    qs, lens, table = (np.asarray(inp[a]) for a in ("query_start", "seq_lens", "page_table"))
    positions, slots = np.zeros(c.tokens, np.int32), np.full(c.tokens, c.num_pages * c.page, np.int32)
    for s in range(len(c.seqs)):
        pos = lens[s] - (qs[s + 1] - qs[s]) + np.arange(qs[s + 1] - qs[s])
        positions[qs[s]:qs[s + 1]] = pos
        slots[qs[s]:qs[s + 1]] = table[s, pos // c.page] * c.page + pos % c.page
    k, v = (jnp.asarray(rng.standard_normal((c.tokens, c.kv_heads, c.head_dim)), dt) for _ in range(2))
    inv_freq = jnp.asarray(1e4 ** -(np.arange(0, c.head_dim, 2) / c.head_dim), jnp.float32)
    return dict(k=k, v=v, positions=jnp.asarray(positions), slots=jnp.asarray(slots), inv_freq=inv_freq)


@on_cpu
@pytest.mark.parametrize("name", ["gqa4_mixed", "long_mixed", "decode_shape", "gqa4_bf16", "prompts_wide"])
def test_cpu_rope_write_attend_matches_references(name: str):
    """The engine's one call per layer on CPU = RoPE and the K/V writes (rope_and_write_reference), then the
    attention reference over the written pools; padding tokens write nothing; with the pools donated
    they are updated in place. prompts_wide: a prompt step's size, with the 125M model's head_dim."""
    wide = Case([(200, 230), (40, 40)], heads=8, kv_heads=4, head_dim=64, tokens=256, slots=3, num_pages=24)
    c = CASES.get(name, wide)
    inp = make_inputs(c, seed=5)
    new = step_tokens(inp, c, np.random.default_rng(6))
    scale = c.head_dim ** -0.5
    q_rot, k_ref, v_ref = jax.jit(rope_and_write_reference)(
        inp["q"], new["k"], new["v"], inp["k_pages"], inp["v_pages"], inp["layer"], new["positions"], new["slots"],
        new["inv_freq"])
    ref = run_reference({**inp, "q": q_rot, "k_pages": k_ref, "v_pages": v_ref}, scale)

    def fused(q, k, v, k_pages, v_pages):
        return cpu.rope_write_attend(q, k, v, k_pages, v_pages, inp["layer"], new["positions"], new["slots"],
                                     new["inv_freq"], inp["page_table"], inp["seq_lens"], inp["query_start"],
                                     inp["num_seqs"], sm_scale=scale)

    args = lambda: [jnp.copy(jax.device_put(x, cpu_devices()[0]))  # noqa: E731
                    for x in (inp["q"], new["k"], new["v"], inp["k_pages"], inp["v_pages"])]
    tol = dict(atol=1e-5, rtol=1e-5) if c.dtype == "float32" else dict(atol=3e-2, rtol=3e-2)
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    for donate in ((), (3, 4)):
        a = args()
        out, k_pages, v_pages = jax.jit(fused, donate_argnums=donate)(*a)
        np.testing.assert_allclose(f64(out), f64(ref), **tol)
        np.testing.assert_allclose(f64(k_pages), f64(k_ref), **tol)
        np.testing.assert_array_equal(f64(v_pages), f64(v_ref))
        assert all(x.is_deleted() for x in a[3:]) == bool(donate)
    written = np.zeros(f64(k_ref).shape, bool)
    layer, real = int(inp["layer"]), np.asarray(new["slots"]) < c.num_pages * c.page
    slots = np.asarray(new["slots"])[real]
    written[layer, :, slots // c.page, slots % c.page] = True
    np.testing.assert_array_equal(f64(k_pages)[~written], f64(inp["k_pages"])[~written])   # nothing else moved


@on_cpu
def test_cpu_rope_write_attend_refuses_disagreeing_shapes():
    c = CASES["decode_shape"]
    inp = make_inputs(c)
    new = step_tokens(inp, c, np.random.default_rng(0))
    with pytest.raises(Exception, match="rope, write and attend: operand shapes or dtypes disagree"):
        jax.block_until_ready(cpu.rope_write_attend(
            inp["q"], new["k"][:, :1], new["v"][:, :1], inp["k_pages"], inp["v_pages"], inp["layer"],
            new["positions"], new["slots"], new["inv_freq"], inp["page_table"], inp["seq_lens"], inp["query_start"],
            inp["num_seqs"], sm_scale=0.25))
    pools = [jnp.zeros(inp["k_pages"].shape, jnp.int8)] * 2                 # quantized pages (tests/test_kv_quant.py)
    flat = jnp.ones(inp["k_pages"].shape[:-1], jnp.bfloat16)               # scales without their trailing axis of 1
    with pytest.raises(Exception, match="operand shapes or dtypes disagree"):
        jax.block_until_ready(cpu.rope_write_attend(
            inp["q"], new["k"], new["v"], *pools, inp["layer"], new["positions"], new["slots"], new["inv_freq"],
            inp["page_table"], inp["seq_lens"], inp["query_start"], inp["num_seqs"], sm_scale=0.25, k_scales=flat,
            v_scales=flat))


@on_cpu
def test_cpu_backend_is_the_default_on_cpu_and_checked():
    assert choose_backend(None, "cpu", head_dim=8, page_size=16) == "cpu"
    assert choose_backend(None, "gpu", head_dim=8, page_size=16) == "xla"         # Triton cannot tile it
    with pytest.raises(ValueError, match="CPU devices only, not gpu"):
        choose_backend("cpu", "gpu", head_dim=64, page_size=16)


def test_without_a_compiler_the_cpu_backend_says_why_and_the_default_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(cpu.BuildError, match="/nonexistent/c\\+\\+"):
        cpu.build()
    monkeypatch.setenv("CXX", "false")           # a compiler that fails
    with pytest.raises(cpu.BuildError, match="failed"):
        cpu.build()
    assert not list(tmp_path.rglob("*.so"))      # nothing half-built left behind
    monkeypatch.setattr(cpu, "_register", lambda: "no C++ compiler")
    assert choose_backend(None, "cpu", head_dim=64, page_size=16) == "xla"
    with pytest.raises(ValueError, match="could not be built: no C\\+\\+ compiler"):
        choose_backend("cpu", "cpu", head_dim=64, page_size=16)


# ---- cross-lowering for CUDA on CPU: proves Triton accepts the kernel's shapes (compiling needs a GPU)

H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


def lower_for_cuda(f, *args) -> str:
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H100)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def realistic(dtype, head_dim: int = 128, heads: int = 32, page: int = 16) -> list[jax.ShapeDtypeStruct]:
    """N=64 tokens, 8 kv heads, 2 layers x 64 pages, 8 sequence slots x 16 pages."""
    sds = jax.ShapeDtypeStruct
    pool = sds((2, 8, 64, page, head_dim), dtype)
    return [sds((64, heads, head_dim), dtype), pool, pool, sds((), jnp.int32), sds((8, 16), jnp.int32),
            sds((8,), jnp.int32), sds((9,), jnp.int32), sds((), jnp.int32)]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("heads,block_q", [(32, None), (32, 16), (8, None), (64, None), (56, None)])
def test_lowers_for_cuda(dtype, heads: int, block_q: int | None):
    """GQA 4 (default and 16-token blocks), 1, 8 and 7 (head group padded to 8)."""
    text = lower_for_cuda(functools.partial(ragged_paged_attention, sm_scale=0.088, block_q=block_q),
                          *realistic(dtype, heads=heads))
    assert "__gpu$xla.gpu.triton" in text


def test_lowers_for_cuda_with_log_sum_exp():
    f = functools.partial(ragged_paged_attention, sm_scale=0.088, return_lse=True)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(f, *realistic(jnp.bfloat16))


def test_partial_lowers_for_cuda():
    """A rank's pages under sp=4: page stride 4, the rank a traced offset."""
    q, k, v, layer, table, _, query_start, num_seqs = realistic(jnp.bfloat16)
    def f(*args):
        return ragged_paged_attention_partial(*args[:-1], sm_scale=0.088, page_stride=4, page_offset=args[-1])

    limit, rank = jax.ShapeDtypeStruct(q.shape[:1], jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(f, q, query_start, num_seqs, limit, k, v, layer, table, rank)


def test_lowers_for_cuda_in_layer_scan():
    """As the engine calls it: inside jit, under a lax.scan over layers (traced layer index)."""
    q, k_pages, v_pages, _, *meta = realistic(jnp.bfloat16)

    def step(q, k_pages, v_pages, *meta):
        def layer_fn(x, layer):
            return ragged_paged_attention(x, k_pages, v_pages, layer, *meta, sm_scale=0.088), None
        return jax.lax.scan(layer_fn, q, jnp.arange(k_pages.shape[0], dtype=jnp.int32))[0]

    assert "__gpu$xla.gpu.triton" in lower_for_cuda(step, q, k_pages, v_pages, *meta)


@pytest.mark.parametrize("head_dim,page,match", [(48, 16, "head_dim 48"), (8, 16, "head_dim 8"),
                                                  (128, 24, "page size 24")])
def test_refuses_shapes_triton_cannot_tile(head_dim: int, page: int, match: str):
    """Caught by the wrapper with a clear message, before Pallas lowers anything."""
    args = realistic(jnp.bfloat16, head_dim, page=page)
    with pytest.raises(ValueError, match=match):
        lower_for_cuda(functools.partial(ragged_paged_attention, sm_scale=0.1), *args)
    with pytest.raises(ValueError, match="block_q 3"):
        lower_for_cuda(functools.partial(ragged_paged_attention, sm_scale=0.1, block_q=3), *realistic(jnp.bfloat16))
