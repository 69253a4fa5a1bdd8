"""Quantized KV pages (EngineConfig.kv_cache_dtype "int8" / "fp8"): the rounding (pallas_kernels/kv_quant.py)
against numpy and ml_dtypes, every attention backend against the unquantized reference within a bound derived
from the quantization step and against its own quantized reference tightly (the jnp reference, the Pallas
kernels in interpret mode, the C++ kernel, the sp ring), the fixture model end to end, the pool's capacity for
a memory budget, what the engine reports, and the refusal of an unknown dtype.

The bound. Quantizing moves each element of K and V by at most eps (int8: scale / 2; e4m3fn: 2^-4 |x| +
scale * 2^-10, its 3 mantissa bits and its subnormal step; the reciprocal's rounding adds < 2^-22 of a step,
covered by a factor 1 + 2^-15). A query row's score for key j then moves by at most
b_j = sm_scale * sum_i |q_i| eps^k_ji, so its softmax weight p'_j = p_j e^d_j / sum_l p_l e^d_l (|d_j| <= b_j)
lies in [p_j e^-b_j / Z+, p_j e^b_j / Z-] with Z+- = sum_l p_l e^+-b_l, and the output
o' - o = sum_j (p'_j - p_j) v_j + sum_j p'_j dv_j is bounded per element by
sum_j |p'_j - p_j| |v_ji| + sum_j max(p'_j) eps^v_ji. The tests compute it per query row and head in float64
from the actual pages and scales (float32 model: dequantizing adds no rounding) and add float32 slack.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer.device.attention import cpu
from jaxinfer.device.kv_cache import PagedKVCache, page_bytes, pool_pages, vector_bytes
from jaxinfer.pallas_kernels.kv_quant import dequantize, qmax, quantize
from jaxinfer.pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from jaxinfer.pallas_kernels.rope_cache import rope, rope_and_write, rope_and_write_reference
from jaxinfer.sampling import SamplingParams

INTERPRET = jax.default_backend() != "gpu"   # JAX_PLATFORMS=cuda runs the Pallas kernels for real
KINDS = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
pytestmark = pytest.mark.usefixtures("float32_dots_exact")


def step_bound(x: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """Per element, how far quantizing may move x (float64; scale broadcasts), kv_quant's rounding."""
    x, scale = np.abs(np.asarray(x, np.float64)), np.asarray(scale, np.float64)
    eps = scale / 2 if kind == "int8" else 2.0 ** -4 * x + scale * 2.0 ** -10
    return np.broadcast_to(eps * (1 + 2.0 ** -15), np.broadcast_shapes(x.shape, scale.shape))


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# ---- the rounding -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_quantize_stays_within_one_step_and_a_zero_vector_stores_zeros(kind: str):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32)) * 10.0 ** rng.uniform(-3, 3, (64, 1))   # vectors of very different sizes
    x[3] = 0.0                                                                   # all zeros: scale 1, zeros stored
    x[5] = 0.0
    x[5, 7] = -2.5                                                               # one element carries the scale
    x = jnp.asarray(x, jnp.float32)
    q, s = jax.jit(quantize, static_argnums=1)(x, KINDS[kind])
    assert q.dtype == KINDS[kind] and s.dtype == jnp.bfloat16 and s.shape == (64, 1)
    amax = np.abs(np.asarray(x)).max(-1, keepdims=True)
    want = (amax * np.float32(1 / qmax(KINDS[kind]))).astype(ml_dtypes.bfloat16)     # rounded before quantizing
    want[amax == 0] = 1
    np.testing.assert_array_equal(np.asarray(s), want)
    qf, back = f64(q), f64(dequantize(q, s, jnp.float32))
    assert np.abs(qf).max() <= qmax(KINDS[kind])
    assert np.all(np.abs(qf[amax[:, 0] > 0]).max(-1) >= qmax(KINDS[kind]) - 1)   # each vector spans the range
    err = np.abs(back - f64(x))
    assert np.all(err <= step_bound(x, s.astype(jnp.float32), kind))
    assert err.max() > 0 and not np.any(back[3]) and np.count_nonzero(back[5]) == 1 and back[5, 7] < 0


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_kernel_rounds_ties_and_reads_every_code_as_numpy_does(kind: str, cpu_kernel):
    """v is written unrotated: rows whose amax makes the scale exactly 1 hold every representable value and ties
    between neighbours (int8: k + 0.5; e4m3fn: midpoints, subnormals included). The C++ write, the jnp
    reference and numpy's rounding (np.round, ml_dtypes' cast: round half to even) store the same bits, and
    each token alone in its sequence attends to its own v only, so the kernel's output is its decoding of them."""
    if cpu_kernel is None:
        pytest.skip("no C++ compiler here")
    rng = np.random.default_rng(1)
    top = qmax(KINDS[kind])
    if kind == "int8":
        values = np.arange(-127, 128, dtype=np.float32)
    else:
        values = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
        values = np.concatenate([values[np.isfinite(values)], [-0.0]])
    ties = np.concatenate([(values[1:] + values[:-1]) / 2, [2.0 ** -10, 3 * 2.0 ** -10] if kind == "fp8" else []])
    n, kv, d = 16, 2, 32
    rest = n * kv * (d - 1) - len(values)
    v = np.concatenate([values, rng.choice(ties, rest)]).astype(np.float32).reshape(n, kv, d - 1)
    v = np.concatenate([np.full((n, kv, 1), top, np.float32), v], -1)   # scale = bf16(top * f32(1 / top)) = 1
    k = rng.standard_normal((n, kv, d)).astype(np.float32)
    pools = (jnp.zeros((1, kv, n, 4, d), KINDS[kind]),) * 2 + (jnp.zeros((1, kv, n, 4, 1), jnp.bfloat16),) * 2
    slots = jnp.arange(n, dtype=jnp.int32) * 4                   # token t: offset 0 of page t
    positions, inv_freq = jnp.zeros(n, jnp.int32), jnp.ones(d // 2, jnp.float32)
    q = jnp.asarray(rng.standard_normal((n, kv, d)), jnp.float32)
    table = jnp.asarray(np.arange(n, dtype=np.int32)[:, None] * np.ones(2, np.int32))      # sequence t: page t
    lens, starts = jnp.ones(n, jnp.int32), jnp.arange(n + 1, dtype=jnp.int32)
    got = jax.jit(functools.partial(cpu.rope_write_attend, sm_scale=1.0))(
        q, jnp.asarray(k), jnp.asarray(v), pools[0], pools[1], jnp.int32(0), positions, slots, inv_freq, table, lens,
        starts, jnp.int32(n), k_scales=pools[2], v_scales=pools[3])
    ref = jax.jit(rope_and_write_reference)(q, jnp.asarray(k), jnp.asarray(v), *pools[:2], 0, positions, slots,
                                            inv_freq, k_scales=pools[2], v_scales=pools[3])
    stored = np.asarray(got[2])[0, :, :, 0].transpose(1, 0, 2)    # [n, KV, D]
    assert np.all(np.asarray(got[4], np.float32)[0, :, :, 0] == 1)
    want = np.round(v).astype(np.int8) if kind == "int8" else v.astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(stored.view(np.uint8), want.view(np.uint8))
    for a, b in zip(got[1:], ref[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got[0]), want.astype(np.float32))


# ---- attention over a step's pages --------------------------------------------------------------------------
# One ragged step: a decode over 40 tokens, a 17-token prompt, a decode over 100, a 20-token chunk after 17
# tokens of context, 11 padding tokens and a padding sequence slot. GQA 4, head_dim 32, pages of 16.
SEQS = [(1, 40), (17, 17), (1, 100), (20, 37)]
HEADS, KV, D, PAGE, PAGES, LAYERS, LAYER, TOKENS, SLOTS, WIDTH = 8, 2, 32, 16, 24, 2, 1, 48, 5, 8
SM_SCALE = D ** -0.5


def make_step(seed: int, dtype=jnp.float32) -> dict:
    """q and unquantized pools (each vector scaled by its own factor in [0.5, 2], so scales differ per vector),
    the page table and the step's per-sequence arrays."""
    rng = np.random.default_rng(seed)
    pool = (LAYERS, KV, PAGES, PAGE, D)
    k, v = (rng.standard_normal(pool) * rng.uniform(0.5, 2, (*pool[:-1], 1)) for _ in range(2))
    table = np.zeros((SLOTS, WIDTH), np.int32)
    free = iter(rng.permutation(PAGES))
    for s, (_, n) in enumerate(SEQS):
        table[s, : -(-n // PAGE)] = [next(free) for _ in range(-(-n // PAGE))]
    q_lens = [a for a, _ in SEQS] + [0] * (SLOTS - len(SEQS))
    return dict(q=jnp.asarray(rng.standard_normal((TOKENS, HEADS, D)), dtype), k_pages=jnp.asarray(k, dtype),
                v_pages=jnp.asarray(v, dtype), layer=jnp.int32(LAYER), page_table=jnp.asarray(table),
                seq_lens=jnp.asarray([b for _, b in SEQS] + [0] * (SLOTS - len(SEQS)), jnp.int32),
                query_start=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                num_seqs=jnp.int32(len(SEQS)))


def quantized(step: dict, kind: str) -> dict:
    """The step's pools as the writes store them: every vector quantized, its scale beside it."""
    (kq, ks), (vq, vs) = (quantize(step[a], KINDS[kind]) for a in ("k_pages", "v_pages"))
    return {**step, "k_pages": kq, "v_pages": vq, "k_scales": ks, "v_scales": vs}


ARGS = ("q", "k_pages", "v_pages", "layer", "page_table", "seq_lens", "query_start", "num_seqs")


def attend(fn, inp: dict, **kw) -> jax.Array:
    scales = {a: inp[a] for a in ("k_scales", "v_scales") if a in inp}
    return jax.jit(functools.partial(fn, sm_scale=SM_SCALE, **kw))(*(inp[a] for a in ARGS), **scales)


def dense_and_bound(step: dict, k: np.ndarray, v: np.ndarray,
                    eps: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float64 causal attention [N, H, D] over pools k, v [L, KV, pages, P, D], and, given each element's eps
    (same shape), the module docstring's bound on what moving K and V by that much may move each output."""
    q, layer, group = f64(step["q"]), int(step["layer"]), HEADS // KV
    k, v = k[layer], v[layer]                                                     # [KV, pages, P, D]
    eps_k, eps_v = (e[layer] for e in eps) if eps is not None else (np.zeros_like(k),) * 2
    out, bound = np.zeros_like(q), np.zeros_like(q)
    starts, table = np.asarray(step["query_start"]), np.asarray(step["page_table"])
    for s, (q_len, n) in enumerate(SEQS):
        pages = table[s, : -(-n // PAGE)]
        kk, vv, ek, ev = (np.repeat(x[:, pages].reshape(KV, -1, D)[:, :n], group, axis=0)   # [H, n, D]
                          for x in (k, v, eps_k, eps_v))
        rows = q[starts[s]: starts[s] + q_len]                                   # [T, H, D]
        visible = np.arange(n)[None, :] <= (n - q_len + np.arange(q_len))[:, None]     # [T, n]
        scores = np.where(visible[None], np.einsum("thd,hsd->hts", rows, kk) * SM_SCALE, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)                                            # [H, T, n]
        b = np.where(visible[None], np.einsum("thd,hsd->hts", np.abs(rows), ek) * SM_SCALE, 0)
        up = p * np.exp(b) / (p * np.exp(-b)).sum(-1, keepdims=True)             # the most p'_j can be
        down = p * np.exp(-b) / (p * np.exp(b)).sum(-1, keepdims=True)          # the least
        moved = np.maximum(up - p, p - down)
        out[starts[s]: starts[s] + q_len] = np.einsum("hts,hsd->thd", p, vv)
        bound[starts[s]: starts[s] + q_len] = (np.einsum("hts,hsd->thd", moved, np.abs(vv))
                                               + np.einsum("hts,hsd->thd", up, ev))
    return out, bound


def real_tokens(step: dict) -> int:
    return int(step["query_start"][int(step["num_seqs"])])


@pytest.mark.parametrize("kind", KINDS)
def test_reference_over_quantized_pages_is_within_the_step_bound(kind: str):
    """The jnp reference over int8 / e4m3fn pages: every stored element within a step of the unquantized page's;
    the output equal to float64 attention over exactly the dequantized pages (so it reads what was stored, where
    it was stored) and within the propagated bound of float64 attention over the unquantized pages; padding
    tokens 0. (e4m3fn's bound, 2^-4 of every |k| with the signs aligned against q, is loose: the errors do not
    align: measured at most an eighth of it, int8 up to 0.72 of its own.)"""
    step = make_step(0)
    inp = quantized(step, kind)
    out = f64(attend(ragged_paged_attention_reference, inp))
    pages = [(f64(step[a]), f64(dequantize(inp[a], inp[s], jnp.float32)), np.asarray(inp[s], np.float32))
             for a, s in (("k_pages", "k_scales"), ("v_pages", "v_scales"))]
    eps = tuple(step_bound(x, scale, kind) for x, _, scale in pages)
    for (x, back, _), e in zip(pages, eps, strict=True):
        assert np.all(np.abs(back - x) <= e)
    n = real_tokens(step)
    read, _ = dense_and_bound(step, pages[0][1], pages[1][1])
    np.testing.assert_allclose(out[:n], read[:n], atol=1e-5, rtol=1e-5)
    dense, bound = dense_and_bound(step, pages[0][0], pages[1][0], eps)
    err = np.abs(out - dense)[:n]
    assert np.all(err <= bound[:n] + 1e-5 + 1e-5 * np.abs(dense[:n])), (err - bound[:n]).max()
    assert err.max() > 1e-4                                          # the pages were quantized, not passed through
    assert not np.any(out[n:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["pallas", "cpu"])
def test_kernels_equal_their_quantized_reference(backend: str, kind: str, dtype: str, cpu_kernel):
    """The Pallas kernel (interpret mode off a GPU) and the C++ kernel dequantize each page as the reference
    does: float32 within float32 rounding, bfloat16 within a bfloat16 step of outputs of magnitude ~4."""
    if backend == "cpu" and (cpu_kernel is None or not INTERPRET):
        pytest.skip("the C++ kernel runs on CPU devices with a C++ compiler")
    inp = quantized(make_step(1, jnp.dtype(dtype)), kind)
    ref = attend(ragged_paged_attention_reference, inp)
    kernel = (functools.partial(ragged_paged_attention, interpret=INTERPRET) if backend == "pallas"
              else cpu.ragged_paged_attention)
    out = attend(kernel, inp)
    assert out.dtype == ref.dtype == inp["q"].dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(f64(out), f64(ref), **tol)
    assert not np.any(f64(out)[real_tokens(inp):])


def step_writes(step: dict, seed: int) -> dict:
    """The step's own K/V (unrotated [N, KV, D]), each token's position and slot (padding: past the pool), and
    inv_freq: what a layer writes before it attends."""
    rng = np.random.default_rng(seed)
    starts, table = np.asarray(step["query_start"]), np.asarray(step["page_table"])
    positions, slots = np.zeros(TOKENS, np.int32), np.full(TOKENS, PAGES * PAGE, np.int32)
    for s, (q_len, n) in enumerate(SEQS):
        pos = n - q_len + np.arange(q_len)
        positions[starts[s]: starts[s] + q_len] = pos
        slots[starts[s]: starts[s] + q_len] = table[s, pos // PAGE] * PAGE + pos % PAGE
    dtype = step["q"].dtype
    k, v = (jnp.asarray(rng.standard_normal((TOKENS, KV, D)) * 2, dtype) for _ in range(2))
    return dict(k=k, v=v, positions=jnp.asarray(positions), slots=jnp.asarray(slots),
                inv_freq=jnp.asarray(1e4 ** -(np.arange(0, D, 2) / D), jnp.float32))


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8 if x.dtype.itemsize == 1 else np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def assert_same_pages(got: tuple, want: tuple) -> None:
    """(k_pages, v_pages, k_scales, v_scales) of two writers: v as it came, bit for bit; k went through RoPE, whose
    float32 result compilers may round an FMA apart, which can move a value across a rounding boundary of the
    quantizer: each dequantized k within one step of the other, nearly all bit for bit."""
    for i in (1, 3):
        np.testing.assert_array_equal(bits(got[i]), bits(want[i]))
    k_got, k_want = (f64(dequantize(x[0], x[2], jnp.float32)) for x in (got, want))
    step = np.maximum(f64(got[2]), f64(want[2]))
    assert np.all(np.abs(k_got - k_want) <= 1.01 * step)
    assert np.mean(bits(got[0]) != bits(want[0])) < 1e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_writes_quantize_rotated_k_and_v_as_the_reference(kind: str, dtype: str, cpu_kernel):
    """rope_and_write_reference stores each written vector quantized within a step of rope(k) and v, its scale
    beside it, and nothing else; the Pallas write and the C++ kernel's one call per layer store the same pages
    (assert_same_pages), and the C++ call attends as the reference does over the pages it wrote."""
    step = quantized(make_step(2, jnp.dtype(dtype)), kind)
    new = step_writes(step, 3)
    pools = tuple(step[a] for a in ("k_pages", "v_pages", "k_scales", "v_scales"))
    args = (step["q"], new["k"], new["v"], *pools[:2], step["layer"], new["positions"], new["slots"],
            new["inv_freq"])
    scales = dict(k_scales=pools[2], v_scales=pools[3])
    ref = jax.jit(rope_and_write_reference)(*args, **scales)
    real = np.asarray(new["slots"]) < PAGES * PAGE
    slots = np.asarray(new["slots"])[real]
    at = (LAYER, slice(None), slots // PAGE, slots % PAGE)                     # [tokens, KV, D] of the written rows
    for x, stored, scale in ((rope(new["k"], new["positions"], new["inv_freq"]), ref[1], ref[3]),
                             (new["v"], ref[2], ref[4])):
        want, back = f64(x)[real], f64(dequantize(stored[at], scale[at], jnp.float32))
        assert np.all(np.abs(back - want) <= step_bound(want, np.asarray(scale[at], np.float32), kind))
    written = np.zeros((LAYERS, KV, PAGES, PAGE), bool)
    written[LAYER, :, slots // PAGE, slots % PAGE] = True
    for before, after in zip(pools, ref[1:], strict=True):               # every other row and scale unchanged
        np.testing.assert_array_equal(bits(before)[~written], bits(after)[~written])

    pallas = rope_and_write(*args, **scales, block_tokens=8, interpret=INTERPRET)
    np.testing.assert_allclose(f64(pallas[0]), f64(ref[0]), rtol=2e-6 if dtype == "float32" else 1e-2)
    assert_same_pages(pallas[1:], ref[1:])

    if cpu_kernel is None or not INTERPRET:
        return
    fused = jax.jit(functools.partial(cpu.rope_write_attend, sm_scale=SM_SCALE))(
        *args, step["page_table"], step["seq_lens"], step["query_start"], step["num_seqs"], **scales)
    assert_same_pages(fused[1:], ref[1:])
    want = attend(ragged_paged_attention_reference, {**step, "q": ref[0], "k_pages": ref[1], "v_pages": ref[2],
                                                     "k_scales": ref[3], "v_scales": ref[4]})
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(f64(fused[0]), f64(want), **tol)


def test_kernels_refuse_pages_without_their_scales():
    inp = quantized(make_step(0), "int8")
    with pytest.raises(ValueError, match="need"):
        ragged_paged_attention(*(inp[a] for a in ARGS), sm_scale=SM_SCALE, interpret=True)
    with pytest.raises(ValueError, match="need k_scales"):
        cpu.ragged_paged_attention(*(inp[a] for a in ARGS), sm_scale=SM_SCALE)


ABSTRACT_H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_kernels_lower_for_cuda(kind: str):
    """The Triton lowering takes the int8 / e4m3fn pages, their scales and the write's PTX rounding (no GPU
    needed: lowered for an abstract H100)."""
    s = jax.ShapeDtypeStruct
    pool, scales = s((2, 4, 32, 16, 64), KINDS[kind]), s((2, 4, 32, 16, 1), jnp.bfloat16)
    q, kv = s((32, 16, 64), jnp.bfloat16), s((32, 4, 64), jnp.bfloat16)
    i32 = lambda *shape: s(shape, jnp.int32)  # noqa: E731

    def write_then_attend(q, k, v, kp, vp, ks, vs, positions, slots, inv_freq, table, lens, starts, num_seqs):
        q, kp, vp, ks, vs = rope_and_write(q, k, v, kp, vp, 1, positions, slots, inv_freq, k_scales=ks, v_scales=vs)
        return ragged_paged_attention(q, kp, vp, 1, table, lens, starts, num_seqs, sm_scale=0.125, k_scales=ks,
                                      v_scales=vs)

    mesh = jax.sharding.AbstractMesh((), (), abstract_device=ABSTRACT_H100)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(write_then_attend).trace(
            q, kv, kv, pool, pool, scales, scales, i32(32), i32(32), s((32,), jnp.float32), i32(4, 8), i32(4),
            i32(5), i32()).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2


# ---- the engine ---------------------------------------------------------------------------------------------
# Logits of the hf-tiny Llama (4 layers, head_dim 8, float32) with quantized pages, against its own run with
# float32 pages: measured 0.0126 (int8) and 0.0547 (fp8) at most on the golden prompts, next to a spread of the
# logits of 0.40 (std). The bounds allow 2.5x that. An e4m3fn step is relative to each element (2^-4), an int8 step
# to the vector's amax (1/254): 16x apart in the worst case, 4x in what they do here.
LOGIT_BOUND = {"int8": 0.03, "fp8": 0.14}


@pytest.fixture(scope="module")
def unquantized(tiny_llm):
    return tiny_llm("llama")


def max_logit_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_fixture_logits_within_the_bound_and_greedy_tokens_agree_where_margins_allow(kind, tiny_llm, unquantized,
                                                                                       golden):
    """The default CPU backend (the C++ kernel) with quantized pages: every prompt position's logits within the
    bound of the float32 pages'; greedy tokens equal, or, where they first part, the float32 pages' logits of the
    two tokens within twice the bound (what the quantized run may have moved each by)."""
    g = golden("llama")
    llm = tiny_llm("llama", kv_cache_dtype=kind)
    assert llm.engine.kv_cache_dtype == jnp.dtype(KINDS[kind]).name and llm.engine.runner.cache.quantized
    ours, ref = llm.logits(g.prompts), unquantized.logits(g.prompts)
    diff = max_logit_diff(ours, ref)
    assert 1e-4 < diff <= LOGIT_BOUND[kind]
    params = SamplingParams(max_tokens=len(g.greedy[0]), temperature=0, ignore_eos=True)
    paths = [o.token_ids for o in llm.generate(g.prompts, params)]
    for prompt, path, want in zip(g.prompts, paths, (o.token_ids for o in unquantized.generate(g.prompts, params)),
                                  strict=True):
        t = next((i for i, (a, b) in enumerate(zip(path, want, strict=True)) if a != b), None)
        if t is not None:
            logits = unquantized.logits([prompt + path[:t]])[0][-1]
            assert abs(logits[path[t]] - logits[want[t]]) <= 2 * LOGIT_BOUND[kind], (t, path[t], want[t])


@pytest.mark.parametrize("kind", KINDS)
def test_requests_batched_equal_each_alone_with_quantized_pages(kind, tiny_llm, golden):
    prompts = golden("llama").prompts
    llm = tiny_llm("llama", kv_cache_dtype=kind)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("mesh, kind", [("sp=2", "fp8"), ("dp=2,pp=2,tp=2", "int8")])
def test_quantized_pages_on_a_mesh_equal_one_device(mesh, kind, tiny_llm, unquantized, golden):
    """The sp ring (fresh K/V travel quantized, pages dealt round the ranks; jnp backend; its plain pages are
    test_sequence_parallel's) and the scales sharded as the pages over dp, pp and tp: the one-device run's logits within
    float32 rounding, so within the bound of the float32 pages', and its greedy tokens (prefill through the ring,
    then decode). Under tp a projection's partial sums are added in another order than on one device, so a
    K or V element can land on the other side of a rounding tie and move one quantization step: the logits
    then agree to within a small fraction of the bound, not to float32 rounding."""
    g = golden("llama")
    llm, one = tiny_llm("llama", mesh=mesh, kv_cache_dtype=kind), tiny_llm("llama", kv_cache_dtype=kind)
    cache = llm.engine.runner.cache
    assert cache.k.dtype == cache.v.dtype == KINDS[kind] and cache.k_scale.sharding == cache.k.sharding
    ours = llm.logits(g.prompts)
    assert max_logit_diff(ours, one.logits(g.prompts)) < (LOGIT_BOUND[kind] / 10 if "tp" in mesh else 1e-5)
    assert max_logit_diff(ours, unquantized.logits(g.prompts)) <= LOGIT_BOUND[kind]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert ([o.token_ids for o in llm.generate(g.prompts[:2], params)]
            == [o.token_ids for o in one.generate(g.prompts[:2], params)])


class FakeGpu:
    """A device that reports its memory, as a GPU does."""

    def memory_stats(self) -> dict:
        return {"bytes_limit": 8 << 30}


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_pool_holds_more_than_1_9x_the_tokens_of_bfloat16(kind, monkeypatch):
    """head_dim 64: 64 elements and a 2-byte scale per vector against 128 bytes, 1.94x. Through the engine's own
    sizing (page_bytes, then pool_pages) for a GPU's memory, and through an Engine on a CPU budget."""
    from jaxinfer import LLM
    from jaxinfer.config import EngineConfig
    from jaxinfer.device import kv_cache
    from jaxinfer.random_model import DEFAULT

    config = EngineConfig()
    pages = {k: pool_pages(config, FakeGpu(), 1 << 30, page_bytes(16, 8, 16, 64, jnp.bfloat16, k), 8192)
             for k in ("auto", kind)}
    assert pages[kind] >= 1.9 * pages["auto"]
    assert vector_bytes(64, jnp.bfloat16, kind) == 66 and vector_bytes(64, jnp.bfloat16) == 128

    monkeypatch.setattr(kv_cache, "CPU_KV_BUDGET", 1 << 20)
    model = {**DEFAULT, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4096}   # head_dim 64
    llms = {k: LLM.random(model, dtype="bfloat16", kv_cache_dtype=k, compilation_cache=False) for k in ("auto", kind)}
    for llm in llms.values():
        llm.close()
    engines = {k: llm.engine for k, llm in llms.items()}
    assert engines[kind].pages_per_replica >= 1.9 * engines["auto"].pages_per_replica
    assert engines[kind].capacity >= 1.9 * engines["auto"].capacity
    cache = engines[kind].runner.cache
    held = sum(x.nbytes for x in cache.pools())
    assert held == engines[kind].pages_per_replica * page_bytes(1, 1, 16, 64, jnp.bfloat16, kind)  # scales counted
    assert held <= 1 << 20


def test_engine_reports_the_kv_cache_dtype_in_metrics_and_json(tiny_llm, hf_tiny, capsys):
    from prometheus_client import CollectorRegistry, generate_latest

    from jaxinfer import launch
    from jaxinfer.serve.metrics import EngineCollector

    llm = tiny_llm("llama", kv_cache_dtype="int8")
    registry = CollectorRegistry()
    registry.register(EngineCollector(llm.loop, "tiny"))
    samples = {s.name: s for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples}
    info = samples["jaxinfer:cache_config_info"]
    assert info.value == 1 and info.labels["kv_cache_dtype"] == "int8"
    assert info.labels["num_pages"] == str(llm.engine.pages_per_replica)
    assert info.labels["kv_bytes_per_token_per_device"] == str(4 * 2 * 2 * (8 + 2))  # layers x KV x (K, V) x bytes

    assert launch.main(["--model", str(hf_tiny / "llama"), "--kv-cache-dtype", "fp8", "--max-tokens", "2",
                        "--no-compilation-cache", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kv_cache_dtype"] == "float8_e4m3fn" and r["kv_bytes_per_token_per_device"] == 4 * 2 * 2 * (8 + 2)


def test_an_unknown_kv_cache_dtype_is_refused(hf_tiny, capsys):
    from jaxinfer import LLM, launch

    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not one of auto, int8, fp8"):
        LLM(hf_tiny / "llama", kv_cache_dtype="int4")
    with pytest.raises(SystemExit) as e:
        launch.main(["--kv-cache-dtype", "int4"])
    assert e.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4'"):
        PagedKVCache.zeros(1, 1, 1, 16, 8, jnp.float32, None, "int4")
