"""The block-wise quantized matmul kernel (jaxinfer.pallas_kernels.block_matmul) against the jnp products it
replaces (jaxinfer.quant.matmul, weight-only; jaxinfer.quant.fp8_matmul, fp8 activations): Triton on a GPU,
interpret mode elsewhere; compiled for an H100 without one, it writes nothing but its output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.bench.hlo_writes import written_arrays
from jaxinfer.pallas_kernels.block_matmul import block_matmul, fits
from jaxinfer.quant import QuantArray, fp8_matmul, matmul

INTERPRET = jax.default_backend() != "gpu"   # JAX_PLATFORMS=cuda runs the kernel for real


def weight(k: int, n: int, block: int, qtype: str, seed: int = 0) -> QuantArray:
    """Random 1-byte values and one positive scale per block of `block` rows and column."""
    rng = np.random.default_rng(seed)
    if qtype == "int8":
        values = jnp.asarray(rng.integers(-127, 128, size=(k, n)), jnp.int8)
    else:
        values = jnp.asarray(rng.normal(size=(k, n)) * 64, jnp.float32).astype(jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(0.5, 2, size=(k // block, n)) / (127 * k ** 0.5), jnp.float32)
    return QuantArray(values, scale, out=1, block=block)


def float32_bound(x: jax.Array, w: QuantArray) -> np.ndarray:
    """Two float32 sums of K products in different orders: at most 2K roundings of 2^-24 of sum |x w| apart."""
    k = x.shape[-1]
    return 2 * k * 2.0 ** -24 * (np.abs(np.asarray(x, np.float32)) @ np.abs(np.asarray(w.dequantize())))


@pytest.mark.parametrize(("rows", "k", "n", "block", "qtype"), [
    (1, 256, 384, 128, "fp8"),     # a decode row; N in tiles of 128
    (5, 192, 48, 64, "int8"),      # N in tiles of 16
    (70, 512, 256, 128, "int8"),   # two row tiles of 64
])
def test_weight_only_is_the_product_per_block(rows, k, n, block, qtype):
    w = weight(k, n, block, qtype, seed=rows)
    x = jax.random.normal(jax.random.key(rows), (rows, k))
    got = block_matmul(x, w.values, w.scale, block=block, interpret=INTERPRET)
    want = matmul(x, w)
    assert got.shape == (rows, n) and got.dtype == x.dtype
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= float32_bound(x, w))
    # bfloat16 rows: the same float32 sums, each output rounded once to bfloat16
    xb = x.astype(jnp.bfloat16)
    got = np.asarray(block_matmul(xb, w.values, w.scale, block=block, interpret=INTERPRET), np.float32)
    want = np.asarray(matmul(xb.astype(jnp.float32), w))
    assert np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + float32_bound(xb, w))


@pytest.mark.parametrize("rows", [1, 33])
def test_fp8_activations_are_the_fp8_gemm_per_block(rows):
    """x quantized to e4m3 per row and block as jaxinfer.quant.fp8_matmul does, the same products."""
    k, n, block = 384, 128, 128
    w = weight(k, n, block, "fp8", seed=rows)
    x = jax.random.normal(jax.random.key(rows), (rows, k)) * jnp.linspace(0.1, 3, k)
    got = block_matmul(x, w.values, w.scale, block=block, fp8_activations=True, interpret=INTERPRET)
    want = fp8_matmul(x, w)
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= 2 * float32_bound(x, w))
    exact = matmul(x, w)   # and e4m3 moves each activation by at most 2^-4 of itself
    assert np.all(np.abs(np.asarray(got - exact)) <= 2.0 ** -4 * float32_bound(x, w) / (2 * k * 2.0 ** -24))


def test_shapes_it_cannot_tile_are_refused():
    w = weight(96, 32, 48, "int8")
    assert not fits(96, 32, 48) and not fits(100, 32, 16) and not fits(128, 24, 64) and fits(128, 32, 64)
    with pytest.raises(ValueError, match=r"blocks of a power of two >= 16 .* got \[96, 32\] in blocks of 48"):
        block_matmul(jnp.ones((2, 96)), w.values, w.scale, block=48, interpret=True)
    with pytest.raises(ValueError, match="fp8_activations needs float8_e4m3fn values, not int8"):
        block_matmul(jnp.ones((2, 128)), weight(128, 32, 64, "int8").values, jnp.ones((2, 32)), block=64,
                     fp8_activations=True, interpret=True)


@pytest.mark.parametrize("fp8_activations", [False, True])
def test_compiled_for_an_h100_it_writes_only_its_output(fp8_activations):
    """One Triton call per product: the program reads the weight and writes y (the rows padded to 16), where
    the products per block in XLA write [K / 128, T, N] float32, as large as the weight at 32 rows."""
    from jaxinfer.device.gpu_target import compile_only_gpus

    mesh = jax.sharding.Mesh(np.array(compile_only_gpus("H100")), ("x",))
    on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    k, n = 4096, 14336
    args = [jax.ShapeDtypeStruct(s, d, sharding=on) for s, d in
            (((32, k), jnp.bfloat16), ((k, n), jnp.float8_e4m3fn), ((k // 128, n), jnp.float32))]
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda x, v, s: block_matmul(x, v, s, block=128, fp8_activations=fp8_activations)).lower(
            *args).compile().as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 1
    assert sum(written_arrays(hlo).values()) == 32 * n * 2
