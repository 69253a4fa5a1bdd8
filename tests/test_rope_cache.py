"""Fused RoPE + paged KV-cache write: reference vs numpy and the HF formula, kernel vs reference (compiled
through Triton on a GPU, interpret mode elsewhere), in-place pool update under donation, and cross-lowering
of the Triton kernel for an H100 on CPU."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.pallas_kernels.kv_quant import dequantize
from jaxinfer.pallas_kernels.rope_cache import rope_and_write, rope_and_write_reference

INTERPRET = jax.default_backend() != "gpu"   # JAX_PLATFORMS=cuda runs the kernel for real
pytestmark = pytest.mark.usefixtures("float32_dots_exact")

KV, L, NUM_PAGES, P = 2, 2, 5, 4
SENTINEL = NUM_PAGES * P


def hf_inv_freq(theta: float, dim: int) -> np.ndarray:
    """transformers' default rope init: 1 / base ** (arange(0, dim, 2) / dim), in float32."""
    return (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)))\
        .astype(np.float32)


def hf_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """transformers' apply_rotary_pos_emb (rotate_half), in numpy float32. x: [N, heads, D]."""
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    x32 = x.astype(np.float32)
    return (x32 * cos + rotated.astype(np.float32) * sin).astype(x.dtype)


def numpy_rope_and_write(q, k, v, k_pages, v_pages, layer, positions, slots, inv_freq):
    """Independent reference: HF RoPE, then one token and one head at a time into fresh copies of the pools."""
    k_rot = hf_rope(k, positions, inv_freq)
    k_pages, v_pages = k_pages.copy(), v_pages.copy()
    page_size, num_pages = k_pages.shape[3], k_pages.shape[2]
    for n, slot in enumerate(slots):
        if not 0 <= slot < num_pages * page_size:
            continue
        for h in range(k.shape[1]):
            k_pages[layer, h, slot // page_size, slot % page_size] = k_rot[n, h]
            v_pages[layer, h, slot // page_size, slot % page_size] = v[n, h]
    return hf_rope(q, positions, inv_freq), k_pages, v_pages


def make_case(seed: int, n: int, heads: int, d: int, dtype, slots) -> tuple:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((n, heads, d), (n, KV, d), (n, KV, d)))
    pools = [rng.standard_normal((L, KV, NUM_PAGES, P, d)).astype(dtype) for _ in range(2)]
    positions = rng.integers(0, 500, n).astype(np.int32)
    return q, k, v, *pools, positions, np.asarray(slots, np.int32), hf_inv_freq(10000.0, d)


# Page boundaries (3|4, 7|8, 16 and 19 = first and last slot of the last page), padding (SENTINEL) in the
# middle, in the same block of 4 as a real token on the last page, and at the end.
SLOTS = [3, 4, SENTINEL, 16, 8, 0, 19, 7, SENTINEL]


def assert_pools(got, want, layer: int, slots, atol: float) -> None:
    """Written rows (layer, real slots) within atol of want; every other element bit-identical (unchanged)."""
    got = np.asarray(got).astype(np.float32).reshape(L, KV, NUM_PAGES * P, -1)
    want = np.asarray(want).astype(np.float32).reshape(L, KV, NUM_PAGES * P, -1)
    written = np.zeros((L, NUM_PAGES * P), bool)
    written[layer, [s for s in slots if 0 <= s < SENTINEL]] = True
    np.testing.assert_allclose(got.transpose(0, 2, 1, 3)[written], want.transpose(0, 2, 1, 3)[written], rtol=0,
                               atol=atol)
    np.testing.assert_array_equal(got.transpose(0, 2, 1, 3)[~written], want.transpose(0, 2, 1, 3)[~written])


@pytest.mark.parametrize("group", [1, 4, 8])
def test_reference_matches_numpy(group):
    case = make_case(group, len(SLOTS), KV * group, 8, np.float32, SLOTS)
    q, k, v, kp, vp, pos, slots, inv = case
    for layer in (0, 1):                      # same inputs, only the layer changes
        got = jax.jit(rope_and_write_reference)(*map(jnp.asarray, (q, k, v, kp, vp)), jnp.int32(layer), pos, slots,
                                                inv)
        want = numpy_rope_and_write(q, k, v, kp, vp, layer, pos, slots, inv)
        np.testing.assert_allclose(np.asarray(got[0]), want[0], rtol=0, atol=2e-6)     # |x| < 6: a few ulp
        assert_pools(got[1], want[1], layer, SLOTS, 2e-6)           # untouched elements (padding) exact
        assert_pools(got[2], want[2], layer, SLOTS, 0.0)            # v is copied, not computed
        np.testing.assert_array_equal(np.asarray(got[1])[1 - layer], kp[1 - layer])   # other layer untouched


@pytest.mark.parametrize("dtype, group", [(np.float32, 1), (np.float32, 4), (jnp.bfloat16, 8)])
def test_kernel_matches_reference(dtype, group):
    # 9 tokens in blocks of 4: a partial last block, padding tokens in the middle and at the end.
    q, k, v, kp, vp, pos, slots, inv = make_case(10 + group, len(SLOTS), KV * group, 8, dtype, SLOTS)
    layer = group % 2
    args = (*map(jnp.asarray, (q, k, v, kp, vp)), jnp.int32(layer), pos, slots, inv)
    want = jax.jit(rope_and_write_reference)(*args)
    got = rope_and_write(*args, block_tokens=4, interpret=INTERPRET)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        g32, w32 = np.asarray(g).astype(np.float32), np.asarray(w).astype(np.float32)
        if dtype == np.float32:
            np.testing.assert_allclose(g32, w32, rtol=0, atol=1e-6)
        else:                                                   # at most one bf16 ulp, on rare ties
            np.testing.assert_allclose(g32, w32, rtol=2**-7, atol=0)
    assert_pools(got[1], want[1], layer, SLOTS, 1e-6 if dtype == np.float32 else 2**-6)
    assert_pools(got[2], want[2], layer, SLOTS, 0.0)


@pytest.mark.parametrize("head_dim", [None, 128])
def test_rope_matches_hf_formula(head_dim, hf_tiny):
    cfg = json.loads((hf_tiny / "llama" / "config.json").read_text())
    theta, d = cfg["rope_theta"], head_dim or cfg["head_dim"]
    assert theta == 10000.0
    n = 501
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((n, 2, d)).astype(np.float32), rng.standard_normal((n, 1, d)).astype(np.float32)
    pos = np.arange(n, dtype=np.int32)                              # positions 0..500
    inv = hf_inv_freq(theta, d)
    pools = jnp.zeros((1, 1, 64, 8, d), jnp.float32)                  # 512 slots: token n -> slot n
    slots = np.arange(n, dtype=np.int32)
    want_q, want_k = hf_rope(q, pos, inv), hf_rope(k, pos, inv)
    for fn in (jax.jit(rope_and_write_reference),
               lambda *a: rope_and_write(*a, block_tokens=64, interpret=INTERPRET)):
        q_rot, kp, _ = fn(q, k, k, pools, pools, 0, pos, slots, jnp.asarray(inv))
        np.testing.assert_allclose(np.asarray(q_rot), want_q, rtol=0, atol=2e-6)
        np.testing.assert_allclose(np.asarray(kp).reshape(-1, d)[:n], want_k[:, 0], rtol=0, atol=2e-6)


def test_pool_updated_in_place_when_donated():
    q, k, v, kp, vp, pos, slots, inv = make_case(0, len(SLOTS), KV * 4, 8, np.float32, SLOTS)

    def args():
        return (*map(jnp.asarray, (q, k, v, kp, vp)), jnp.int32(1), pos, slots, inv)

    def kernel(*a):
        return rope_and_write(*a, block_tokens=4, interpret=INTERPRET)

    pool_shape = f"f32[{L},{KV},{NUM_PAGES},{P},8]"
    for fn in (rope_and_write_reference, kernel):
        donated = jax.jit(fn, donate_argnums=(3, 4))
        hlo = donated.lower(*args()).compile().as_text()
        assert re.search(r"input_output_alias=\{ \{1\}: \(3, \{\}, may-alias\), \{2\}: \(4, \{\}, may-alias\)", hlo)
        assert not re.search(re.escape(pool_shape) + r"\{[0-9,]+\} copy\(", hlo), "full copy of the pool"
        a = args()
        out = donated(*a)
        assert a[3].is_deleted() and a[4].is_deleted()                # the buffers were reused
        assert out[1].shape == kp.shape


@pytest.mark.parametrize("kind, hlo_type", [(jnp.int8, "s8"), (jnp.float8_e4m3fn, "f8e4m3fn")])
def test_quantized_pools_and_scales_updated_in_place_when_donated(kind, hlo_type):
    """int8 / e4m3fn pages (tests/test_kv_quant.py): the pools and their scales are all aliased, none copied,
    and kernel and reference store the same bits."""
    q, k, v, kp, vp, pos, slots, inv = make_case(0, len(SLOTS), KV * 4, 8, np.float32, SLOTS)

    def args():
        scales = jnp.zeros((*kp.shape[:-1], 1), jnp.bfloat16)
        return (*map(jnp.asarray, (q, k, v)), jnp.zeros(kp.shape, kind), jnp.zeros(vp.shape, kind), scales,
                jnp.copy(scales))

    def run(fn):
        def call(q, k, v, kp, vp, ks, vs):
            return fn(q, k, v, kp, vp, jnp.int32(1), pos, slots, inv, k_scales=ks, v_scales=vs)

        donated = jax.jit(call, donate_argnums=(3, 4, 5, 6))
        hlo = donated.lower(*args()).compile().as_text()
        aliases = ", ".join(rf"\{{{i}\}}: \({i + 2}, \{{\}}, may-alias\)" for i in range(1, 5))
        assert re.search(r"input_output_alias=\{ " + aliases, hlo)
        assert not re.search(rf"{hlo_type}\[{L},{KV},{NUM_PAGES},{P},8\]\{{[0-9,]+\}} copy\(", hlo)
        a = args()
        out = donated(*a)
        assert all(x.is_deleted() for x in a[3:])
        return out

    got, want = run(lambda *a, **kw: rope_and_write(*a, **kw, block_tokens=4, interpret=INTERPRET)), \
        run(rope_and_write_reference)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=0, atol=2e-6)   # an FMA apart at most
    for pool, scale in ((1, 3), (2, 4)):   # rotated k an FMA apart may round the other way: one step at most
        moved = np.abs(np.asarray(dequantize(got[pool], got[scale], jnp.float32))
                       - np.asarray(dequantize(want[pool], want[scale], jnp.float32)))
        assert np.all(moved <= 1.01 * np.asarray(want[scale], np.float32))


ABSTRACT_H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


def cross_lower(f, *args) -> str:
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=ABSTRACT_H100)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def gpu_shapes(n=64, h=32, kv=8, d=128, layers=2, pages=64, page=16, dtype=jnp.bfloat16):
    s = jax.ShapeDtypeStruct
    pool = s((layers, kv, pages, page, d), dtype)
    return (s((n, h, d), dtype), s((n, kv, d), dtype), s((n, kv, d), dtype), pool, pool, s((), jnp.int32),
            s((n,), jnp.int32), s((n,), jnp.int32), s((d // 2,), jnp.float32))


def test_cross_lowers_for_h100():
    text = cross_lower(rope_and_write, *gpu_shapes())
    call = next(line for line in text.splitlines() if "xla.gpu.triton" in line)
    assert "grid_x = 4 : i32, grid_y = 8 : i32" in call                    # 64 tokens / 16, 8 kv heads
    assert "output_operand_alias<output_tuple_indices = [1], operand_index = 7" in call
    assert "output_operand_alias<output_tuple_indices = [2], operand_index = 8" in call

    def layers_scan(q, k, v, kp, vp, _layer, positions, slots, inv_freq):
        def body(carry, layer):                                         # the layer is a traced scan index
            q_rot, kp, vp = rope_and_write(q, k, v, *carry, layer, positions, slots, inv_freq)
            return (kp, vp), q_rot
        return jax.lax.scan(body, (kp, vp), jnp.arange(kp.shape[0], dtype=jnp.int32))

    assert "xla.gpu.triton" in cross_lower(layers_scan, *gpu_shapes())


@pytest.mark.parametrize("kw, block, match", [({"d": 7}, 16, "head_dim 7"), ({"d": 96}, 16, "head_dim 96"),
                                              ({"h": 12, "kv": 8}, 16, "not a multiple"),
                                              ({}, 12, "block_tokens 12")])
def test_refuses_unsupported_shapes_before_lowering(kw, block, match):
    with pytest.raises(ValueError, match=match):
        cross_lower(lambda *a: rope_and_write(*a, block_tokens=block), *gpu_shapes(**kw))
