"""Expert-parallel MoE: the jnp reference against the Hugging Face algorithm written as a numpy loop, the
shard_map version against the reference on many meshes, forced imbalance, ties, padding, and the
communication of the compiled program (two all-to-alls, one all-reduce only at tp > 1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer import sharding
from jaxinfer.collectives import collective_report
from jaxinfer.device.moe import moe, moe_reference, route
from jaxinfer.mesh import MeshConfig
from jaxinfer.quant import QuantArray
from jaxinfer.sharding import Layout

RULES = tuple(dict(sharding.RULES, batch=("dp", "ep"), experts="ep").items())
N = 8  # tokens per replica


def make_inputs(r: int, e: int, m: int, x_: int, seed: int = 0, dtype=jnp.float32, valid_frac: float = 0.8):
    """(x, router, w_gate, w_up, w_down, valid): gate and up apart, as the Hugging Face loop takes them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(r, N, e))
    router = rng.normal(size=(e, x_))
    w_gate, w_up = rng.normal(size=(2, x_, e, m)) / e**0.5
    w_down = rng.normal(size=(x_, m, e)) / m**0.5
    valid = rng.random((r, N)) < valid_frac
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(x), cast(router), cast(w_gate), cast(w_up), cast(w_down), jnp.asarray(valid)


def fused(args, shards: int):
    """The arguments of moe / moe_reference: gate and up [X, E, M] -> one [X, E, shards, 2M / shards], block g
    = [gate columns of shard g, up columns of shard g] (what the loader stores for `shards` tp devices)."""
    x, router, w_gate, w_up, w_down, valid = args
    blocks = lambda w: np.split(np.asarray(w), shards, axis=-1)  # noqa: E731
    gate_up = np.stack([np.concatenate(gu, -1) for gu in zip(blocks(w_gate), blocks(w_up), strict=True)], axis=2)
    return x, router, jnp.asarray(gate_up, w_gate.dtype), w_down, valid


def hf_loop(x, router, w_gate, w_up, w_down, valid, top_k, normalize):
    """Mixtral / Qwen3-MoE sparse block, token by token: float32 routing, stable sort of -probs."""
    x, router, w_gate, w_up, w_down = (np.asarray(a, np.float32) for a in (x, router, w_gate, w_up, w_down))
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    y, counts = np.zeros(x.shape, np.float64), np.zeros((x.shape[0], router.shape[1]), np.int64)
    for r in range(x.shape[0]):
        for t in range(x.shape[1]):
            if not valid[r, t]:
                continue
            logits = x[r, t] @ router
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            chosen = np.argsort(-probs, kind="stable")[:top_k]
            weights = probs[chosen] / (probs[chosen].sum() if normalize else 1)
            for ex, w in zip(chosen, weights, strict=True):
                counts[r, ex] += 1
                h = silu(x[r, t] @ w_gate[ex]) * (x[r, t] @ w_up[ex])
                y[r, t] += w * (h @ w_down[ex])
    return y, counts


def layout_for(cfg: MeshConfig) -> Layout:
    return Layout(cfg.make(), RULES)


def jit_moe(layout: Layout, args, top_k: int, normalize: bool):
    """Gate and up fused for the layout's tp, every argument device_put with its rules sharding; returns
    (jitted fn, placed args)."""
    x, router, w_gate_up, w_down, valid = fused(args, layout.axis_size("mlp"))
    placed = (jax.device_put(x, layout.sharding(("batch", "seq", "embed"))),
              jax.device_put(router, NamedSharding(layout.mesh, P())),
              jax.device_put(w_gate_up, layout.sharding(("experts", "embed", "mlp", None))),
              jax.device_put(w_down, layout.sharding(("experts", "mlp", "embed"))),
              jax.device_put(valid, layout.sharding(("batch", "seq"))))
    fn = jax.jit(lambda *a: moe(*a, top_k=top_k, normalize=normalize, layout=layout))
    return fn, placed


def check_equal(cfg: MeshConfig, args, top_k: int, normalize: bool):
    fn, placed = jit_moe(layout_for(cfg), args, top_k, normalize)
    y, counts = fn(*placed)
    y_ref, counts_ref = moe_reference(*fused(args, 1), top_k=top_k, normalize=normalize)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(counts_ref))
    assert counts.dtype == jnp.int32 and y.dtype == args[0].dtype
    return y, counts


@pytest.mark.parametrize("e,m,x_,top_k,normalize,shards", [(16, 24, 8, 2, True, 1), (32, 48, 16, 4, False, 2),
                                                           (16, 24, 8, 4, True, 4)])
def test_reference_matches_hf_loop(e, m, x_, top_k, normalize, shards):
    args = make_inputs(3, e, m, x_, seed=e + top_k)
    y_ref, counts_ref = moe_reference(*fused(args, shards), top_k=top_k, normalize=normalize)
    y_hf, counts_hf = hf_loop(*args, top_k, normalize)
    np.testing.assert_allclose(np.asarray(y_ref), y_hf, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(counts_ref), counts_hf)


@pytest.mark.parametrize("mesh,x_,top_k,normalize", [
    (MeshConfig(), 8, 2, True),
    (MeshConfig(ep=2), 8, 4, True),
    (MeshConfig(ep=4), 8, 2, False),
    (MeshConfig(ep=8), 8, 2, True),
    (MeshConfig(ep=8), 16, 4, True),
    (MeshConfig(ep=2, tp=2), 8, 4, False),
    (MeshConfig(dp=2, ep=4), 8, 2, True),
    (MeshConfig(ep=4, tp=2), 16, 4, True),
], ids=str)
def test_moe_matches_reference(mesh, x_, top_k, normalize):
    args = make_inputs(mesh.dp * mesh.ep, 16, 24 if x_ == 8 else 48, x_, seed=mesh.size + x_ + top_k)
    check_equal(mesh, args, top_k, normalize)


@pytest.mark.parametrize("x_,top_k", [(8, 2), (16, 4)])
def test_forced_imbalance_drops_nothing(x_, top_k):
    """Every token picks the same top_k experts, all owned by ep rank 2: that rank receives C = n * k
    assignments from every source, the worst case the capacity is sized for."""
    mesh = MeshConfig(ep=4)
    x, router, *rest, valid = make_inputs(4, 16, 24, x_, seed=7)
    x = jnp.abs(x) + 0.5
    hot = np.arange(top_k) + 2 * x_ // 4  # the experts of rank 2
    router = router.at[:, hot].set(3.0 - 0.05 * np.arange(top_k))
    args = (x, router, *rest, valid)
    y, counts = check_equal(mesh, args, top_k, True)
    expected = np.zeros((4, x_), np.int64)
    expected[:, hot] = np.asarray(valid).sum(1)[:, None]
    np.testing.assert_array_equal(np.asarray(counts), expected)
    y_hf, _ = hf_loop(*args, top_k, True)  # larger activations here: float32 sums in another order
    np.testing.assert_allclose(np.asarray(y), y_hf, atol=5e-5, rtol=0)


@pytest.mark.parametrize("top_k,chosen", [(2, [1, 3]), (4, [1, 3, 6, 0])])
def test_ties_pick_lower_expert_index(top_k, chosen):
    """Experts 1, 3 and 6 get bit-identical logits (integer inputs: every sum is exact), the rest 0."""
    x_ = 8
    x, _, w_gate, w_up, w_down, valid = make_inputs(4, 16, 24, x_, seed=3)
    x = jnp.asarray(np.random.default_rng(3).integers(1, 3, size=x.shape), jnp.float32)
    router = jnp.zeros((16, x_), jnp.float32).at[:, [1, 3, 6]].set(1.0)
    args = (x, router, w_gate, w_up, w_down, valid)
    _, counts = check_equal(MeshConfig(ep=4), args, top_k, True)
    expected = np.zeros((4, x_), np.int64)
    expected[:, chosen] = np.asarray(valid).sum(1)[:, None]
    np.testing.assert_array_equal(np.asarray(counts), expected)
    y_hf, counts_hf = hf_loop(*args, top_k, True)
    np.testing.assert_array_equal(counts_hf, expected)
    np.testing.assert_allclose(np.asarray(moe_reference(*fused(args, 1), top_k=top_k, normalize=True)[0]), y_hf,
                               atol=1e-5)


def test_padding_not_counted_and_ignored():
    mesh = MeshConfig(dp=2, ep=2)
    x, *weights, valid = make_inputs(4, 16, 24, 8, seed=11, valid_frac=0.6)
    valid = valid.at[1].set(False)  # a replica with no real tokens at all
    y, counts = check_equal(mesh, (x, *weights, valid), 2, True)
    assert int(counts[1].sum()) == 0
    assert int(counts.sum()) == 2 * int(valid.sum())
    assert not np.asarray(y)[~np.asarray(valid)].any()  # padding outputs are 0
    noise = jnp.where(valid[..., None], x, 100.0)  # what padding holds changes nothing
    y2, counts2 = check_equal(mesh, (noise, *weights, valid), 2, True)
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(counts2), np.asarray(counts))


def test_bfloat16_runs_and_packs_ids():
    """bf16 sends its int32 expert ids as two uint16 columns; routing and counts still match."""
    args = make_inputs(4, 16, 24, 8, seed=5, dtype=jnp.bfloat16)
    fn, placed = jit_moe(layout_for(MeshConfig(ep=4)), args, 2, True)
    y, counts = fn(*placed)
    y_ref, counts_ref = moe_reference(*fused(args, 1), top_k=2, normalize=True)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), atol=3e-2)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(counts_ref))


@pytest.mark.parametrize("mesh,dtype", [(MeshConfig(ep=4), jnp.float32), (MeshConfig(ep=4), jnp.bfloat16),
                                        (MeshConfig(ep=2, tp=2), jnp.float32)], ids=str)
def test_compiled_collectives(mesh, dtype):
    e, top_k = 16, 2
    args = make_inputs(mesh.ep, e, 24, 8, dtype=dtype)
    fn, placed = jit_moe(layout_for(mesh), args, top_k, True)
    report = collective_report(fn.lower(*placed).compile().as_text())
    b, cap = jnp.dtype(dtype).itemsize, N * top_k
    dispatch, combine = mesh.ep * cap * (e * b + 4), mesh.ep * cap * e * b
    assert report["all-to-all"] == {"count": 2, "bytes": dispatch + combine}
    assert report["all-gather"]["count"] == 0  # expert weights never move
    assert report["collective-permute"]["count"] == 0 and report["reduce-scatter"]["count"] == 0
    all_reduce = {"count": 1, "bytes": N * e * b} if mesh.tp > 1 else {"count": 0, "bytes": 0}
    assert report["all-reduce"] == all_reduce  # one [n, E] all-reduce over tp, like a dense MLP


def quantized_experts_run(mesh: MeshConfig, block: int | None, top_k: int, e: int = 16, m: int = 24,
                          qtype: str | None = "int8", backend: str = "xla"):
    """moe on 16 experts with int8 values and one scale per `block` rows of each contraction (None: per output
    channel; qtype None: plain float32 experts) on `backend` -> (its output, the reference's on the dequantized
    weights)."""
    x_ = 16
    x, router, *_, valid = make_inputs(mesh.ep, e, m, x_, seed=block or 0)
    rng = np.random.default_rng(block or 0)
    shapes = ((x_, e, m), (x_, e, m), (x_, m, e))
    if qtype is None:
        weights = [jnp.asarray(rng.normal(size=shape) / shape[1] ** 0.5, jnp.float32) for shape in shapes]
        fn, placed = jit_moe(layout_for(mesh), (x, router, *weights, valid), top_k, True)
        y_ref, _ = moe_reference(*fused((x, router, *weights, valid), 1), top_k=top_k, normalize=True)
        return fn(*placed)[0], y_ref
    values = [jnp.asarray(rng.integers(-127, 128, size=shape), jnp.int8) for shape in shapes]
    blocks = [v.shape[1] if block is None else block for v in values]
    scales = [jnp.asarray(rng.uniform(0.2, 1, size=(x_, -(-v.shape[1] // b), v.shape[2])), jnp.float32)
              / (127 * v.shape[1] ** 0.5) for v, b in zip(values, blocks, strict=True)]
    _, _, gu_values, down_values, _ = fused((x, router, *values, valid), mesh.tp)
    _, _, gu_scale, down_scale, _ = fused((x, router, *scales, valid), mesh.tp)
    gate_up = QuantArray(gu_values, gu_scale, out=2, block=blocks[0], axes=("embed", "mlp", None))
    down = QuantArray(down_values, down_scale, out=1, block=blocks[2], axes=("mlp", "embed"))
    layout = layout_for(mesh)
    place = lambda a, axes: jax.device_put(a, layout.sharding(axes))  # noqa: E731
    placed = (place(x, ("batch", "seq", "embed")), jax.device_put(router, NamedSharding(layout.mesh, P())),
              gate_up.replace(values=place(gate_up.values, ("experts", "embed", "mlp", None)),
                              scale=place(gate_up.scale, ("experts", None, "mlp", None))),
              down.replace(values=place(down.values, ("experts", "mlp", "embed")),
                           scale=place(down.scale, ("experts", None, "embed"))),
              place(valid, ("batch", "seq")))
    y, _ = jax.jit(lambda *a: moe(*a, top_k=top_k, normalize=True, layout=layout, backend=backend))(*placed)
    gate, up, w_down = (v.astype(jnp.float32) * jnp.repeat(s, b, axis=1)[:, : v.shape[1]]
                        for v, s, b in zip(values, scales, blocks, strict=True))
    y_ref, _ = moe_reference(*fused((x, router, gate, up, w_down, valid), 1), top_k=top_k, normalize=True)
    return y, y_ref


@pytest.mark.parametrize("mesh,block,top_k,backend", [
    (MeshConfig(tp=2), 12, 12, "xla"),  # 96 rows for 16 experts; down's 24 rows split at 12
    (MeshConfig(tp=2), 12, 2, "xla"),   # 16 rows: each device's own blocks of down
    (MeshConfig(tp=2), 16, 1, "xla"),   # down's 24 rows split inside a block: dequantized on each device
    (MeshConfig(), 8, 1, "xla"),        # one device, whole blocks
    (MeshConfig(ep=2), None, 6, "xla"),  # per channel: 48 rows a device for its 8 experts
    (MeshConfig(tp=2), 12, 12, "cpu"),  # the C++ grouped matmul: each device's own blocks, partial ones too
    (MeshConfig(ep=2), None, 2, "cpu"),  # ... per channel, most experts without rows
], ids=str)
def test_block_quantized_experts_match_the_reference(cpu_kernel, mesh, block, top_k, backend):
    """Experts with int8 values and one scale per `block` rows of each contraction (gate/up's 16 rows in
    blocks of 12: a partial last block): each device takes its own rows' scales, in the grouped product or
    in each row's own expert's, and the output is the reference's on the dequantized weights, to float32's
    rounding."""
    if backend == "cpu" and cpu_kernel is None:
        pytest.skip("no C++ compiler: the engine runs the jnp reference, tested everywhere else")
    y, y_ref = quantized_experts_run(mesh, block, top_k, backend=backend)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mesh,qtype,block,top_k", [
    (MeshConfig(tp=2), "int8", 16, 4),     # gate/up's 32 rows in 2 blocks; each device's 16 rows of down in 1
    (MeshConfig(), "int8", 16, 1),         # fewer rows than experts: a decode step, each group a row or two
    (MeshConfig(ep=2), "int8", None, 2),   # per output channel, over two expert-parallel devices
    (MeshConfig(ep=2, tp=2), None, None, 2),   # plain float32 experts
], ids=str)
def test_the_gpu_kernel_route_matches_the_reference(monkeypatch, mesh, qtype, block, top_k):
    """On GPUs the experts go through the grouped matmul kernel (jaxinfer.pallas_kernels.grouped_matmul): run
    here in interpret mode, twice per layer (gate/up, down), it gives the reference's output to float32's
    rounding, whichever way the experts are stored or split."""
    import jaxinfer.device.moe as moe_module
    from jaxinfer.pallas_kernels import grouped_matmul

    calls = []
    kernel = grouped_matmul.grouped_matmul
    monkeypatch.setattr(moe_module, "KERNEL_PLATFORMS", ("gpu", "cpu"))
    monkeypatch.setattr(grouped_matmul, "grouped_matmul", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    y, y_ref = quantized_experts_run(mesh, block, top_k, e=32, m=32, qtype=qtype)
    assert len(calls) == 2 and all(call["interpret"] for call in calls)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("qtype,block", [(None, None), ("int8", None), ("int8", 8), ("fp8", 8)], ids=str)
def test_each_row_through_its_expert_equals_the_tiles(qtype, block):
    """The grouped product's two forms off the kernel, on the same rows (some experts empty, rows past the
    groups): each row times its own expert (GPUs, for shapes the kernel does not tile) and each expert's rows
    in tiles (elsewhere), both against the dequantized experts' ragged_dot."""
    from jaxinfer.device.moe import _per_row, _tiled

    rng = np.random.default_rng(7)
    x_, k, n = 6, 24, 10
    sizes = jnp.asarray([3, 0, 9, 1, 0, 4], jnp.int32)
    rows = int(sizes.sum()) + 3                                   # three empty slots last
    expert = jnp.minimum(jnp.repeat(jnp.arange(x_), sizes, total_repeat_length=rows), x_ - 1)
    xs = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
    if qtype is None:
        w = plain = jnp.asarray(rng.normal(size=(x_, k, n)), jnp.float32)
    else:
        blk = block or k
        values = (rng.integers(-127, 128, size=(x_, k, n)) if qtype == "int8" else rng.normal(size=(x_, k, n)) * 40)
        w = QuantArray(jnp.asarray(values, jnp.int8 if qtype == "int8" else jnp.float8_e4m3fn),
                       jnp.asarray(rng.uniform(1e-3, 2e-3, size=(x_, -(-k // blk), n)), jnp.float32), out=1, block=blk)
        plain = w.dequantize()
    want = jax.lax.ragged_dot(xs, plain, sizes, precision=jax.lax.Precision.HIGHEST)
    valid = np.arange(rows) < int(sizes.sum())
    np.testing.assert_allclose(np.asarray(_tiled(xs, w, sizes)), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(_per_row(xs, w, expert))[valid], np.asarray(want)[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("valid", [True, False])
def test_a_lone_row_routed_as_two_is_routed_as_itself(valid):
    """GPUs route one row padded to two (its router product a GEMM): the padding is invalid, so the row's
    experts and the expert counts are its own, and its weights too, to the rounding of a GEMM's sums."""
    x, router, *_ = make_inputs(1, 16, 24, 8, seed=3)
    one, alone = x[:, :1], jnp.full((1, 1), valid)
    (weights, experts, counts), (weights1, experts1, counts1) = (
        route(one, router, alone, top_k=2, normalize=True, min_rows=rows) for rows in (2, 1))
    assert weights.shape == weights1.shape and experts.shape == experts1.shape == (1, 1, 2)
    np.testing.assert_array_equal(experts, experts1)
    np.testing.assert_array_equal(counts, counts1)
    assert int(counts.sum()) == 2 * valid
    np.testing.assert_allclose(weights, weights1, rtol=1e-5, atol=0)


def test_moe_refuses_experts_not_divisible_by_ep():
    args = fused(make_inputs(4, 16, 24, 6), 1)
    with pytest.raises(ValueError, match=r"6 experts .* ep=4"):
        moe(*args, top_k=2, normalize=True, layout=layout_for(MeshConfig(ep=4)))


def test_batch_must_be_sharded_over_ep():
    layout = Layout(MeshConfig(ep=2).make(), tuple(dict(sharding.RULES, batch="dp", experts="ep").items()))
    with pytest.raises(ValueError, match="sharded over 'ep'"):
        moe(*fused(make_inputs(2, 16, 24, 8), 1), top_k=2, normalize=True, layout=layout)
