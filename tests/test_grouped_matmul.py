"""The experts' grouped matmul kernel (jaxinfer.pallas_kernels.grouped_matmul) against `lax.ragged_dot` on the
dequantized experts, and with fp8 activations against jaxinfer.quant.fp8_matmul per group: Triton on a GPU,
interpret mode elsewhere; compiled for an H100 without one, it writes nothing but its output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxinfer.bench.hlo_writes import written_arrays
from jaxinfer.pallas_kernels.grouped_matmul import fits, grouped_matmul
from jaxinfer.quant import QuantArray, fp8_matmul

INTERPRET = jax.default_backend() != "gpu"   # JAX_PLATFORMS=cuda runs the kernel for real
SIZES = [5, 0, 23, 1, 9]   # an empty group, one across a 16-row tile boundary; 7 rows past the groups


def experts(x: int, k: int, n: int, qtype: str | None, block: int | None, seed: int = 0):
    """(values [X, K, N], scale [X, blocks, N] or None, the dequantized float32 experts)."""
    rng = np.random.default_rng(seed)
    if qtype is None:
        w = jnp.asarray(rng.normal(size=(x, k, n)) / k ** 0.5, jnp.float32)
        return w, None, w
    if qtype == "int8":
        values = jnp.asarray(rng.integers(-127, 128, size=(x, k, n)), jnp.int8)
    else:
        values = jnp.asarray(rng.normal(size=(x, k, n)) * 64, jnp.float32).astype(jnp.float8_e4m3fn)
    blocks = 1 if block is None else k // block
    scale = jnp.asarray(rng.uniform(0.5, 2, size=(x, blocks, n)) / (127 * k ** 0.5), jnp.float32)
    dense = values.astype(jnp.float32) * jnp.repeat(scale, k // blocks, axis=1)
    return values, scale, dense


def float32_bound(x: jax.Array, dense: jax.Array, sizes) -> np.ndarray:
    """Two float32 sums of K products in different orders: at most 2K roundings of 2^-24 of sum |x w| apart."""
    k = x.shape[-1]
    expert = np.repeat(np.arange(len(sizes)), sizes)
    rows = np.abs(np.asarray(x[: len(expert)], np.float32))
    bound = np.zeros((x.shape[0], dense.shape[-1]), np.float32)
    bound[: len(expert)] = np.einsum("rk,rkn->rn", rows, np.abs(np.asarray(dense))[expert])
    return 2 * k * 2.0 ** -24 * bound


@pytest.mark.parametrize(("qtype", "block"), [(None, None), ("int8", None), ("fp8", None), ("int8", 32)])
def test_each_group_times_its_own_expert(qtype, block):
    """Plain, per-channel and block-wise experts: lax.ragged_dot's rows (0 past the groups), within float32
    rounding; bfloat16 rows round each output once."""
    sizes = jnp.asarray(SIZES, jnp.int32)
    values, scale, dense = experts(len(SIZES), 64, 48, qtype, block, seed=len(qtype or ""))
    xs = jax.random.normal(jax.random.key(1), (sum(SIZES) + 7, 64))
    got = grouped_matmul(xs, values, scale, sizes, block=block, interpret=INTERPRET)
    want = lax.ragged_dot(xs, dense, sizes, precision=lax.Precision.HIGHEST)
    assert got.shape == want.shape and got.dtype == xs.dtype
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= float32_bound(xs, dense, SIZES))
    assert not np.any(np.asarray(got[sum(SIZES):]))
    xb = xs.astype(jnp.bfloat16)
    got = np.asarray(grouped_matmul(xb, values, scale, sizes, block=block, interpret=INTERPRET), np.float32)
    want = np.asarray(lax.ragged_dot(xb.astype(jnp.float32), dense, sizes, precision=lax.Precision.HIGHEST))
    assert np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + float32_bound(xb, dense, SIZES))


@pytest.mark.parametrize("block", [64, None])
def test_fp8_activations_are_the_fp8_gemm_per_group(block):
    """fp8 experts with the rows quantized to e4m3 per row and block (per row, per-channel experts): each
    group's rows through jaxinfer.quant.fp8_matmul with its expert, within float32 rounding."""
    sizes = [3, 17, 0, 4]
    values, scale, dense = experts(len(sizes), 128, 32, "fp8", block, seed=3)
    xs = jax.random.normal(jax.random.key(2), (sum(sizes), 128)) * jnp.linspace(0.1, 3, 128)
    got = grouped_matmul(xs, values, scale, jnp.asarray(sizes, jnp.int32), block=block, fp8_activations=True,
                         interpret=INTERPRET)
    starts = np.cumsum([0, *sizes])
    want = jnp.concatenate([fp8_matmul(xs[a:b], QuantArray(values[e], scale[e], out=1, block=block or 128))
                            for e, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True))])
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= 2 * float32_bound(xs, dense, sizes))


def test_shapes_it_cannot_tile_are_refused():
    values, scale, _ = experts(2, 96, 32, "int8", 48)
    assert fits(96, 32) and not fits(96, 32, 48) and not fits(72, 32) and not fits(64, 24) and fits(128, 32, 64)
    sizes = jnp.asarray([1, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"got \(2, 96, 32\) for rows \[2, 96\] in blocks of 48"):
        grouped_matmul(jnp.ones((2, 96)), values, scale, sizes, block=48, interpret=True)
    values, scale, _ = experts(2, 64, 32, "int8", None)
    with pytest.raises(ValueError, match="fp8_activations needs float8_e4m3fn values with scales, not int8"):
        grouped_matmul(jnp.ones((2, 64)), values, scale, sizes, fp8_activations=True, interpret=True)


def test_compiled_for_an_h100_it_writes_only_its_output():
    """Qwen3-30B-A3B's experts (128 of [2048, 1536], fp8 in 128 x 128 blocks) for 32 sequences' 8 choices: one
    Triton call, whose only write is its output (as ragged_dot, XLA wrote a masked copy of the rows per
    expert and read every expert)."""
    from jaxinfer.device.gpu_target import compile_only_gpus

    mesh = jax.sharding.Mesh(np.array(compile_only_gpus("H100")), ("x",))
    on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x, k, n, rows = 128, 2048, 1536, 256
    args = [jax.ShapeDtypeStruct(s, d, sharding=on) for s, d in
            (((rows, k), jnp.bfloat16), ((x, k, n), jnp.float8_e4m3fn), ((x, k // 128, n), jnp.float32),
             ((x,), jnp.int32))]
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda *a: grouped_matmul(*a, block=128, fp8_activations=True)).lower(*args).compile().as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 1
    writes = written_arrays(hlo)
    assert writes[("pallas_call.0", f"bf16[{rows},{n}]")] == rows * n * 2
    assert sum(writes.values()) < 1.1 * rows * n * 2   # and the tile map
