"""The weight-only quantized matmul (jaxinfer/device/quant_matmul_cpu.py): its jnp reference against an explicit
numpy product, and the C++ kernel against the reference.

Tolerance: kernel and reference both sum in float32, in different orders (the kernel scales partial sums of
up to 128 rows of K, and adds the sums of the parts of K its threads take; the reference scales each weight),
so each is within (K + 2) * 2^-24 * sum_k |x[m, k] * w[k, n]| of the exact product (the classic bound for a
float32 sum of K products, each of its terms rounded at most K + 2 times), and they are within twice that of
each other. A result in bfloat16 or float16 adds one ulp of that dtype (at most eps * |value|): two float32
values on either side of a rounding boundary round one ulp apart.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.device import quant_matmul_cpu as q


def cpu_device():
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:                       # JAX_PLATFORMS=cuda: a GPU run of the kernel tests
        return None


on_cpu = pytest.mark.skipif(cpu_device() is None, reason="the C++ kernel runs on CPU devices; JAX_PLATFORMS has none")


@pytest.fixture
def kernel():
    """Skips where the kernel cannot be built (no C++ compiler), as the attention kernel's tests fall back."""
    if not q.available():
        pytest.skip(f"the C++ kernel is unavailable: {q.unavailable_reason()}")


def make(m: int, k: int, n: int, block: int, values: str, x_dtype: str = "float32", seed: int = 0,
         nan: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x ~ N(0, 1); int8 values over all of -128..127; fp8 values over every finite code (subnormals, +-0 and
    +-448 included), or with a few NaN codes (0x7f, 0xff) where `nan`; bfloat16 and float16 values N(0, 1)
    times powers of two from 2^-12 to 2^11 (float16's subnormals among them); scales in [0.5, 2) / 64."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32).astype(jnp.dtype(x_dtype))
    if values == "int8":
        v = rng.integers(-128, 128, (k, n)).astype(np.int8)
    elif values in ("bfloat16", "float16"):
        v = (rng.standard_normal((k, n)) * 2.0 ** rng.integers(-12, 12, (k, n))).astype(jnp.dtype(values))
    else:
        codes = rng.integers(0, 256, (k, n)).astype(np.uint8)
        codes[(codes & 0x7F) == 0x7F] -= 1
        if nan:
            codes[rng.integers(0, k, 3), rng.integers(0, n, 3)] = [0x7F, 0xFF, 0x7F]
        v = codes.view(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (-(-k // block), n)).astype(np.float32) / 64
    return x, v, scale


def exact(x: np.ndarray, v: np.ndarray, scale: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x @ (values * repeat(scale)) in float64, and sum_k |x[m, k] * w[k, n]| (for the tolerance)."""
    w = v.astype(np.float64) * np.repeat(scale.astype(np.float64), block, axis=0)[: v.shape[0]]
    xs = x.astype(np.float64)
    return xs @ w, np.abs(xs) @ np.abs(w)


def tolerance(magnitude: np.ndarray, value: np.ndarray, k: int, dtype, orders: int) -> np.ndarray:
    """`orders` float32 summation orders' worth of rounding over K terms, plus an ulp of the result's dtype."""
    rounding = 0.0 if jnp.dtype(dtype) == jnp.float32 else float(jnp.finfo(dtype).eps)
    return orders * (k + 2) * 2.0 ** -24 * magnitude + rounding * np.abs(value)


def run(f, x, v, scale, block):
    dev = cpu_device()
    return np.asarray(jax.jit(functools.partial(f, block=block))(*jax.device_put((x, v, scale), dev)), np.float64)


CASES = {                      # (M, K, N, block): odd sizes on purpose
    "per_channel": (1, 200, 37, 200),
    "block128_k200": (5, 200, 37, 128),
    "block48_k100": (70, 100, 37, 48),
    # M * K * N past the kernel's 2^23 multiply-adds, on two threads or more where the machine has the cores:
    "threads_split_k": (3, 2800, 1025, 128),  # up to 4 rows: K in parts (here through a block), sums added
    "threads_columns": (9, 920, 1025, 64),    # more rows: the columns in parts
    "threads_wide": (4, 160, 20000, 64),      # few rows, but their sums in K's parts would take 2.5 MB: columns
    "threads_panel": (20, 416, 1025, 48),     # the columns in parts, the weights converted once (16 rows on)
    "threads_rows": (100, 288, 301, 64),      # chunks of 96 rows at most, of equal size
    "threads_chunks": (200, 160, 301, 64),    # 3 chunks of 67 rows on 2 threads: the columns in 2 parts as well
}


@on_cpu
@pytest.mark.parametrize("values", ["int8", "float8_e4m3fn", "bfloat16"])
@pytest.mark.parametrize("case", ["per_channel", "block128_k200", "block48_k100"])
def test_reference_is_the_explicit_numpy_product(case: str, values: str):
    m, k, n, block = CASES[case]
    for x_dtype in ("float32", "bfloat16"):
        x, v, scale = make(m, k, n, block, values, x_dtype)
        want, magnitude = exact(x, v, scale, block)
        got = run(q.quantized_matmul_reference, x, v, scale, block)
        assert got.shape == (m, n)
        np.testing.assert_array_less(np.abs(got - want), tolerance(magnitude, want, k, x_dtype, orders=1) + 1e-30)


@on_cpu
@pytest.mark.parametrize("values", ["int8", "float8_e4m3fn", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(kernel, case: str, values: str):
    m, k, n, block = CASES[case]
    for x_dtype in ("float32", "bfloat16") if not case.startswith("threads") else ("float32",):
        x, v, scale = make(m, k, n, block, values, x_dtype, seed=1)
        ref = run(q.quantized_matmul_reference, x, v, scale, block)
        out = run(q.quantized_matmul, x, v, scale, block)
        _, magnitude = exact(x, v, scale, block)
        np.testing.assert_array_less(np.abs(out - ref), tolerance(magnitude, ref, k, x_dtype, orders=2) + 1e-30)


@on_cpu
@pytest.mark.parametrize("values", ["int8", "float16"])
def test_kernel_float16_x_and_result(kernel, values: str):
    m, k, n, block = CASES["block128_k200"]
    x, v, scale = make(m, k, n, block, values, "float16", seed=2)
    out = jax.jit(functools.partial(q.quantized_matmul, block=block))(x, v, scale)
    assert out.dtype == jnp.float16 and out.shape == (m, n)
    ref = run(q.quantized_matmul_reference, x, v, scale, block)
    _, magnitude = exact(x, v, scale, block)
    np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - ref),
                                 tolerance(magnitude, ref, k, "float16", orders=2) + 1e-30)


@on_cpu
@pytest.mark.parametrize("m", [1, 20])
def test_fp8_nan_codes_give_nan_columns_as_in_the_reference(kernel, m: int):
    """0x7f and 0xff are NaN in e4m3fn (it has no infinities): each poisons its column, and only it."""
    k, n, block = 100, 70, 48
    x, v, scale = make(m, k, n, block, "float8_e4m3fn", nan=True, seed=3)
    ref = run(q.quantized_matmul_reference, x, v, scale, block)
    out = run(q.quantized_matmul, x, v, scale, block)
    nan_columns = np.isnan(v.astype(np.float32)).any(axis=0)
    assert nan_columns.any()
    np.testing.assert_array_equal(np.isnan(out), np.broadcast_to(nan_columns, (m, n)))
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(out))
    _, magnitude = exact(x, np.where(np.isnan(v.astype(np.float32)), 0, v.astype(np.float32)), scale, block)
    ok = ~nan_columns
    np.testing.assert_array_less(np.abs(out - ref)[:, ok],
                                 tolerance(magnitude, ref, k, "float32", orders=2)[:, ok] + 1e-30)


@pytest.mark.parametrize("f", [q.quantized_matmul, q.quantized_matmul_reference])
def test_bad_operands_raise_value_errors_naming_the_shapes(f):
    x, v, scale = make(3, 100, 37, 48, "int8")
    with pytest.raises(ValueError, match=r"x \(3, 100\), values \(100, 37\), scale \(2, 37\) with block 48"):
        f(x, v, scale[:2], block=48)                          # ceil(100 / 48) = 3 blocks
    with pytest.raises(ValueError, match=r"values \(99, 37\)"):
        f(x, v[:99], scale, block=48)
    with pytest.raises(ValueError, match=r"values \(100, 37\) must be one of \('int8', 'float8_e4m3fn', 'bfloat16', "
                                         r"'float16'\), not uint8"):
        f(x, v.view(np.uint8), scale, block=48)
    with pytest.raises(ValueError, match=r"x \(3, 100\) must be one of"):
        f(x.astype(np.int32), v, scale, block=48)
    with pytest.raises(ValueError, match=r"got x \(100,\), values \(100, 37\), scale \(3, 37\)"):
        f(x[0], v, scale, block=48)
    with pytest.raises(ValueError, match="block must be a positive int"):
        f(x, v, scale, block=0)


GROUPED = {   # (sizes of the groups, rows of x, K, N, block): empty groups, rows past the groups
    "per_channel": ([3, 0, 4, 1, 0], 10, 200, 37, 200),
    "blocks_partial": ([0, 2, 5, 0, 6], 13, 100, 70, 48),
    # from "decode" on, past the kernel's 2^23 multiply-adds in all: the work on two threads or more
    "decode": ([1, 0, 0, 1], 2, 2816, 1500, 128),               # a row per chosen expert, threads splitting K
    "many_rows": ([40, 0, 17], 57, 480, 307, 64),               # the panel path, columns split over threads
    "mixed": ([4, 8, 1], 13, 960, 700, 64),                     # K in parts for 4 rows, columns for 8
    "cut": ([3, 5, 2], 6, 100, 37, 100),                        # groups past the rows: cut at the last row
}


def make_grouped(sizes, rows, k, n, block, values, x_dtype="float32", seed=0):
    x, *_ = make(rows, k, n, block, values, x_dtype, seed)
    per = [make(1, k, n, block, values, seed=seed + 1 + g)[1:] for g in range(len(sizes))]
    v, scale = (np.stack(a) for a in zip(*per, strict=True))
    return x, v, scale, np.asarray(sizes, np.int32)


def run_grouped(f, x, v, scale, sizes, block):
    call = jax.jit(functools.partial(f, block=block))
    return np.asarray(call(*jax.device_put((x, v, scale, sizes), cpu_device())), np.float64)


@on_cpu
@pytest.mark.parametrize("values", ["int8", "float8_e4m3fn", "bfloat16"])
@pytest.mark.parametrize("case", list(GROUPED))
def test_grouped_kernel_is_each_groups_matmul(kernel, case: str, values: str):
    """Each group of rows times its own expert, as the single matmul's reference computes it; rows past the
    groups are 0. The reference itself is the explicit product, row by row."""
    sizes, rows, k, n, block = GROUPED[case]
    for x_dtype in ("float32", "bfloat16") if case != "many_rows" else ("float32",):
        x, v, scale, s = make_grouped(sizes, rows, k, n, block, values, x_dtype, seed=4)
        out = run_grouped(q.grouped_quantized_matmul, x, v, scale, s, block)
        ref = run_grouped(q.grouped_quantized_matmul_reference, x, v, scale, s, block)
        want, magnitude = np.zeros((rows, n)), np.zeros((rows, n))
        start = 0
        for g, size in enumerate(sizes):
            rows_g = slice(start, min(start + size, rows))
            want[rows_g], magnitude[rows_g] = exact(x[rows_g], v[g], scale[g], block)
            start = min(start + size, rows)
        assert not out[start:].any() and not ref[start:].any()
        np.testing.assert_array_less(np.abs(ref - want), tolerance(magnitude, want, k, x_dtype, orders=1) + 1e-30)
        np.testing.assert_array_less(np.abs(out - ref), tolerance(magnitude, ref, k, x_dtype, orders=2) + 1e-30)


@pytest.mark.parametrize("f", [q.grouped_quantized_matmul, q.grouped_quantized_matmul_reference])
def test_grouped_bad_operands_raise_value_errors_naming_the_shapes(f):
    x, v, scale, sizes = make_grouped([2, 1], 3, 100, 37, 48, "int8")
    with pytest.raises(ValueError, match=r"sizes \(3,\) int32"):
        f(x, v, scale, np.zeros(3, np.int32), block=48)
    with pytest.raises(ValueError, match=r"sizes \(2,\) int64"):
        f(x, v, scale, sizes.astype(np.int64), block=48)
    with pytest.raises(ValueError, match=r"values \(2, 100, 37\) and scale \(1, 3, 37\) differ in experts"):
        f(x, v, scale[:1], sizes, block=48)
    with pytest.raises(ValueError, match=r"values \(100, 37\), scale \(2, 37\) with block 48"):
        f(x, v, scale[:, :2], sizes, block=48)


@on_cpu
@pytest.mark.parametrize(("name", "mesh", "quantization", "dense", "grouped"), [
    ("llama", "tp=2", None, 5, 0), ("qwen3_moe", "", None, 3, 2),
    ("llama", "", "int8", 5, 0),     # int8 layers, the bfloat16 LM head: both kinds in one step
])
def test_engine_reads_16_bit_weights_through_the_kernel(kernel, hf_tiny, golden, name, mesh, quantization, dense,
                                                        grouped):
    """A bfloat16 model on the cpu backend: its matmul weights, the LM head's included (qkv, o, gate_up, down,
    lm_head; a mixture's experts through the grouped kernel), are the kernel's calls, XLA multiplies none of
    them (a dense model's step has no dot at all), and the logits stay within bfloat16's rounding of the float32
    reference: to first order each of the 4 roundings of a layer's activations (2^-8 relative at most) moves
    the logits by at most that fraction of their scale (int8 weights add their half step, 1/254, to each); a
    mixture's near-tied experts may flip, so it is held to the KL gate instead."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.quant import QuantArray

    g = golden(name)
    llm = LLM(hf_tiny / name, mesh=mesh, dtype="bfloat16", quantization=quantization)
    try:
        assert llm.engine.runner.backend == "cpu"
        assert (llm.quantization or {}).get("weights") == quantization
        held = [w for w in jax.tree.leaves(llm.weights, is_leaf=lambda w: isinstance(w, QuantArray))
                if isinstance(w, QuantArray)]
        assert len(held) == dense + grouped
        assert [w.values.dtype for w in held].count(jnp.dtype(jnp.bfloat16)) == (1 if quantization else len(held))
        llm.generate(g.prompts[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        hlo = llm.engine.runner.last["decode"].as_text()
        assert hlo.count('custom_call_target="jaxinfer_quantized_matmul"') == dense
        assert hlo.count('custom_call_target="jaxinfer_grouped_quantized_matmul"') == grouped
        if not grouped:
            assert " dot(" not in hlo
        layers = llm.config.num_layers
        for i, logits in enumerate(llm.logits(g.prompts)):
            want = g.logits[i, : len(g.prompts[i])]
            if grouped:
                p = np.exp(want - want.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                log_q = logits - logits.max(-1, keepdims=True)
                log_q = log_q - np.log(np.exp(log_q).sum(-1, keepdims=True))
                assert (p * (np.log(p) - log_q)).sum(-1).max() < 0.02
            else:
                eps = 2.0 ** -8 + (0.5 / 127 if quantization else 0)
                bound = 4 * layers * eps * np.abs(want).max()
                assert np.abs(logits - want).max() <= bound, (np.abs(logits - want).max(), bound)
    finally:
        llm.close()
