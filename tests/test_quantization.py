"""Quantized weights: int8 and fp8 quantized as they load, and the pre-quantized formats people download
(transformers' block-wise FP8, compressed-tensors), on the hf-tiny fixtures and across layouts.

What is exact and what is bounded:
- A pre-quantized checkpoint loads to exactly its stored values times its scales (each weight equal to its
  dequantized twin's, written by quantized_checkpoints.py), and serves the twin's logits.
- Quantizing as it loads gives exactly what compressed-tensors' per-channel scheme stores for the same weights.
- Every layout serves the one-device quantized model's logits (float32 summation order aside).
- Against the unquantized model (transformers' reference logits): quantizing moves a weight by at most half
  a step, relative to its column's largest magnitude eps = 1/254 (int8) or 2^-4 (e4m3, 3 mantissa bits). To
  first order each of the n quantized matmuls a token passes through (4 per layer) moves the output by at
  most eps of its scale, so a dense model's logits move at most n * eps * max|logit|. A mixture's routing
  can flip near-tied experts, which no smooth bound covers: there, and everywhere, the per-token KL
  divergence stays under MaxText's logit-checker gate of 0.02.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.bench.quant import one_byte_copies
from jaxinfer.checkpoint import CheckpointError
from jaxinfer.device.matmul import contraction_minor
from jaxinfer.plan.compiled import compile_layout
from jaxinfer.plan.planner import weight_dtype
from jaxinfer.quant import QMAX, QuantArray, by_blocks, fp8_matmul, matmul, max_error, quantize

sys.path.insert(0, str(Path(__file__).parent))
from quantized_checkpoints import write  # noqa: E402

DENSE = ["llama", "llama3_scaled", "qwen2", "qwen3"]
MOE = ["mixtral", "qwen3_moe"]
EPS = {"int8": 0.5 / QMAX["int8"], "fp8": 2.0 ** -4}
KL_GATE = 0.02


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def quantized_leaves(llm: LLM) -> list[QuantArray]:
    return [x for x in jax.tree.leaves(llm.weights, is_leaf=lambda x: isinstance(x, QuantArray))
            if isinstance(x, QuantArray)]


@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_quantize_stays_within_half_a_step(qtype):
    w = jax.random.normal(jax.random.key(0), (3, 40, 2, 24)) * jnp.linspace(0.01, 10, 24)  # [lead, K, *out]
    w = w.at[0, :, 1, 5].set(0.0)                               # an all-zero column keeps a finite scale
    q = quantize(w, qtype, contract=1, out=2)
    assert q.values.dtype == jnp.dtype("int8" if qtype == "int8" else jnp.float8_e4m3fn)
    assert q.scale.shape == (3, 1, 2, 24) and q.contract == 1 and q.block == 40
    err = jnp.abs(w - q.dequantize())
    assert bool(jnp.all(err <= max_error(w, q))) and float(err.max()) > 0
    assert not bool(jnp.any(q.dequantize()[0, :, 1, 5]))
    # matmul scales the product of x and the values; against the product with the dequantized weight only
    # float32's rounding differs: at most K roundings of 2^-24 of sum_k |x_k w_k| each way
    x = jax.random.normal(jax.random.key(1), (5, 40))
    w1 = q.dequantize()[1]
    bound = 2 * 40 * 2.0 ** -24 * jnp.einsum("nk,kgo->ngo", jnp.abs(x), jnp.abs(w1))
    err = jnp.abs(matmul(x, jax.tree.map(lambda a: a[1], q)) - jnp.einsum("nk,kgo->ngo", x, w1))
    assert bool(jnp.all(err <= bound))


def test_block_scales_cover_partial_blocks():
    """A contraction of 100 rows in blocks of 48: the third block is partial."""
    values = jax.random.randint(jax.random.key(0), (100, 7), -127, 128).astype(jnp.int8)
    scale = jax.random.uniform(jax.random.key(1), (3, 7))
    q = QuantArray(values, scale, out=1, block=48)
    expected = np.asarray(values, np.float32) * np.repeat(np.asarray(scale), 48, axis=0)[:100]
    np.testing.assert_array_equal(q.dequantize(), expected)
    # matmul: block by block for 3 rows (a float32 product per block, scaled, summed), dequantized first for
    # 300; either way the product with the dequantized weight, to float32's rounding
    for rows in (3, 300):
        x = jax.random.normal(jax.random.key(rows), (rows, 100))
        assert by_blocks(x, q) == (rows == 3)
        bound = 2 * 100 * 2.0 ** -24 * (np.abs(x) @ np.abs(expected))
        assert np.all(np.abs(matmul(x, q) - np.asarray(x) @ expected) <= bound)


@pytest.mark.parametrize("name", DENSE + MOE)
def test_fixture_logits_within_the_quantization_bound(tiny_llm, golden, name):
    ref = golden(name)
    for qtype in ("int8", "fp8"):
        llm = tiny_llm(name, quantization=qtype)
        assert len(quantized_leaves(llm)) == 4                      # q/k/v, o, gate/up, down: one stack each
        layers = llm.config.num_layers
        for i, logits in enumerate(llm.logits(ref.prompts)):
            want = ref.logits[i, : len(ref.prompts[i])]
            kl = (np.exp(log_softmax(want)) * (log_softmax(want) - log_softmax(logits))).sum(-1)
            assert kl.max() < KL_GATE, (qtype, kl.max())
            if name in DENSE:
                bound = 4 * layers * EPS[qtype] * np.abs(want).max()
                assert np.abs(logits - want).max() <= bound, (qtype, np.abs(logits - want).max(), bound)


@pytest.mark.parametrize(("name", "qtype", "meshes"), [("llama", "int8", ["tp=4", "pp=2", "sp=2"]),
                                                       ("qwen3_moe", "fp8", ["ep=4", "tp=2", "pp=2,ep=2", "sp=2"])])
def test_layouts_serve_the_one_device_quantized_model(tiny_llm, golden, name, qtype, meshes):
    prompts = golden(name).prompts
    one = tiny_llm(name, quantization=qtype).logits(prompts)
    for mesh in meshes:
        for a, b in zip(tiny_llm(name, mesh, quantization=qtype).logits(prompts), one, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=mesh)


@pytest.fixture(scope="module")
def prequantized(hf_tiny, tmp_path_factory):
    """prequantized(name, method, **kw) -> (checkpoint, dequantized twin), written once per module."""
    made = {}

    def make(name: str, method: str, **kw) -> tuple[Path, Path]:
        key = (name, method, tuple(sorted(kw.items())))
        if key not in made:
            dst = tmp_path_factory.mktemp("quantized") / f"{name}-{method}"
            made[key] = write(hf_tiny / name, dst, method, **kw)
        return made[key]
    return make


@pytest.mark.parametrize(("name", "method", "kw", "mesh"), [
    ("llama", "fp8", {"block": (32, 48)}, "tp=2"),             # blocks not square, 64 inputs in blocks of 48
    ("qwen3", "compressed-tensors", {"strategy": "channel", "qtype": "fp8"}, "tp=2"),
    ("qwen2", "fp8", {"strategy": "tensor"}, "pp=2"),          # AutoFP8: one 0-d weight_scale, input_scale too
    ("llama", "compressed-tensors", {"strategy": "group", "qtype": "int8", "block": (1, 24), "scale_dtype": "bfloat16"},
     None),                                                    # groups of 24 of the 64 inputs, bfloat16 scales
    ("qwen3_moe", "compressed-tensors", {"strategy": "block", "qtype": "int8", "block": (16, 24)}, "ep=2"),
])
def test_prequantized_checkpoint_is_its_values_times_scales(prequantized, name, method, kw, mesh):
    path, twin = prequantized(name, method, **kw)
    qtype = kw.get("qtype", "fp8")
    prompts = [[1, 5, 9, 33, 2, 7, 11], [1, 40, 41]]
    for m in ("", mesh) if mesh else ("",):
        llm, ref = (LLM(p, mesh=m, dtype="float32", compilation_cache=False) for p in (path, twin))
        try:
            leaves = quantized_leaves(llm)
            assert len(leaves) == 4 and all(q.values.dtype == jnp.dtype(
                jnp.float8_e4m3fn if qtype == "fp8" else jnp.int8) for q in leaves)
            assert llm.parameter_bytes_per_device() < 0.6 * ref.parameter_bytes_per_device()
            # the planner (and --mesh auto) holds the checkpoint's weights as it is served: its bytes, its dtype
            planned = compile_layout(llm.config, llm.mesh_config, llm.dtype, llm.engine.config, 1, programs=False,
                                     stored=llm.stored_quantization)
            assert planned.weight_bytes == llm.parameter_bytes_per_device()
            assert set(planned.weight_bytes_by_dtype) == {"float32", qtype}
            assert weight_dtype(llm.dtype, llm.engine.config, llm.stored_quantization) == qtype
            flat = jax.tree.leaves(llm.weights, is_leaf=lambda x: isinstance(x, QuantArray))
            for ours, want in zip(flat, jax.tree.leaves(ref.weights), strict=True):
                got = ours.dequantize(jnp.float32) if isinstance(ours, QuantArray) else ours
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            for a, b in zip(llm.logits(prompts), ref.logits(prompts), strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        finally:
            llm.close()
            ref.close()


@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_quantizing_as_it_loads_matches_the_per_channel_format(tiny_llm, prequantized, qtype):
    """On-the-fly quantization of the fixture = what compressed-tensors' channel scheme stores for it (the
    scales to one float32 rounding: XLA divides amax by qmax as a multiplication by its reciprocal)."""
    path, _ = prequantized("qwen3", "compressed-tensors", strategy="channel", qtype=qtype)
    stored = LLM(path, dtype="float32", compilation_cache=False)
    try:
        for a, b in zip(quantized_leaves(tiny_llm("qwen3", quantization=qtype)), quantized_leaves(stored),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a.values.astype(jnp.float32)),
                                          np.asarray(b.values.astype(jnp.float32)))
            np.testing.assert_allclose(np.asarray(a.scale), np.asarray(b.scale), rtol=2.0 ** -23, atol=0)
    finally:
        stored.close()


def test_refused_with_a_clear_message(hf_tiny, prequantized, tmp_path):
    with pytest.raises(ValueError, match="quantization 'int4' is not one of int8, fp8"):
        LLM(hf_tiny / "llama", quantization="int4")
    path, _ = prequantized("llama", "fp8", block=(32, 48))
    with pytest.raises(ValueError, match="stored quantized .*fp8.* cannot be served as quantization='int8'"):
        LLM(path, quantization="int8")
    bad = tmp_path / "awq"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CheckpointError, match="quant_method 'awq' is not supported"):
        LLM(bad)
    # scales missing for a quantized tensor: the config's block size points at tensors that are not there
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}}))
    with pytest.raises(CheckpointError, match=r"lacks tensor 'model\.layers\.0\.self_attn\.q_proj\.weight_scale' "
                                              r"\(the scales of a quantized tensor"):
        LLM(bad)
    # compressed-tensors' packed formats (int4 in int32 words) and groups that a g_idx reorders
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}
    for qc, message in (({"format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
                        ({"format": "int-quantized", "config_groups": {"g": {"weights": weights | {"num_bits": 8,
                          "actorder": "group"}}}}, r"activation order \(actorder='group'\) are not supported")):
        (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {
            "quant_method": "compressed-tensors", "config_groups": {"g": {"weights": weights}}, **qc}}))
        with pytest.raises(CheckpointError, match=message):
            LLM(bad)
    # 8-bit tensors without any quantization_config
    (bad / "config.json").write_text(json.dumps(config | {"quantization_config": None}))
    with pytest.raises(CheckpointError, match="is stored as F8_E4M3, but config.json declares no quantization"):
        LLM(bad)


def test_cli_refuses_an_unknown_quantization(capsys):
    from jaxinfer import launch

    with pytest.raises(SystemExit) as e:
        launch.main(["--quantization", "int4"])
    assert e.value.code == 2 and "--quantization: invalid choice: 'int4'" in capsys.readouterr().err


def test_engine_config_names_the_choices():
    from jaxinfer.config import EngineConfig

    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization 'nf4'"):
        dataclasses.replace(EngineConfig(), quantization="nf4")


@pytest.mark.parametrize(("name", "qtype"), [("llama", "int8"), ("qwen3_moe", "fp8")])
def test_cpu_backend_reads_the_one_byte_weights(tiny_llm, cpu_kernel, name, qtype):
    """On XLA:CPU the quantized matmuls are the C++ kernel's calls (a mixture's experts the grouped one's), and
    no dequantized copy of a weight is made per step; the result is the dequantize-then-matmul reference's."""
    if cpu_kernel is None:
        pytest.skip("no C++ compiler: the engine runs the jnp reference, tested everywhere else")
    prompts = [[1, 5, 9, 33, 2, 7, 11]]
    llm = tiny_llm(name, quantization=qtype)       # the test above's: the CPU kernels are the default here
    assert llm.engine.runner.backend == "cpu"
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    hlo = llm.engine.runner.last["decode"].as_text()
    dense, grouped = (2, 2) if name in MOE else (4, 0)       # qkv, o (gate_up, down); the experts' gate_up, down
    assert hlo.count('custom_call_target="jaxinfer_quantized_matmul"') == dense
    assert hlo.count('custom_call_target="jaxinfer_grouped_quantized_matmul"') == grouped
    # no fused computation turns 1-byte weights into floats (what the jnp reference compiles to)
    assert not re.search(r"(s8|f8e4m3fn)\[[0-9,]+\][^\n]*\) -> (f32|bf16)\[", hlo)
    reference = tiny_llm(name, attention_backend="xla", quantization=qtype).logits(prompts)
    np.testing.assert_allclose(llm.logits(prompts)[0], reference[0], atol=1e-4, rtol=0)


def test_fp8_gemm_cross_lowers_for_hopper():
    """On a GPU with fp8 tensor cores an fp8 weight meets activations quantized per token as one float8 dot
    (XLA rewrites it to a cuBLASLt fp8 GEMM); each activation moves by at most 2^-4 of itself, so each output
    by at most 2^-4 of sum_k |x_k w_kj| (plus e4m3's subnormal floor)."""
    w = jax.random.normal(jax.random.key(0), (100, 3, 8))
    x = jax.random.normal(jax.random.key(1), (1, 2, 100))   # few rows: block-wise too by blocks (`by_blocks`)
    for q in (quantize(w, "fp8", contract=1, out=2),                   # per channel, and in blocks of 48 rows
              QuantArray(quantize(w, "fp8", contract=1, out=2).values, jax.random.uniform(jax.random.key(2), (3, 3, 8)),
                         out=2, block=48)):
        exact = matmul(x, q)
        bound = 2.0 ** -4 * jnp.einsum("tnk,kgo->tngo", jnp.abs(x), jnp.abs(q.dequantize())) + 1e-3
        assert bool(jnp.all(jnp.abs(fp8_matmul(x, q) - exact) <= bound))
        dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
            text = jax.jit(fp8_matmul).trace(x.astype(jnp.bfloat16), q).lower(lowering_platforms=("cuda",)).as_text()
        dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
        assert dots and all("f8E4M3FN>, tensor<" in d and d.count("f8E4M3FN") >= 2 for d in dots), dots
    # a weight stored as gemm_layouts stores it reaches the CUDA program with its contraction (dim 0) minor
    q = quantize(w[:, 0], "fp8", contract=1, out=1)
    q = q.replace(values=jax.device_put(q.values, contraction_minor(q)))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.format), q)
    text = jax.jit(fp8_matmul).trace(x.astype(jnp.bfloat16), abstract).lower(lowering_platforms=("cuda",)).as_text()
    assert re.search(r"%arg1: tensor<100x8xf8E4M3FN> \{mhlo.layout_mode = \"\{0,1\}\"", text), text[:2000]


def test_fp8_weights_are_stored_as_the_fp8_gemm_reads_them(hf_tiny, monkeypatch):
    """Where the devices have fp8 GEMMs, each per-channel fp8 weight's values are stored contraction-minor (what
    cuBLASLt takes without a transpose per step), sharded as before, and the steps are compiled for the
    arrays as stored; the logits are those of the same model with its weights stored row-major. Here on CPU
    devices made to claim fp8 GEMMs, at tp=2 (so each device holds its own shards in that layout)."""
    from jaxinfer import llm as llm_module
    from jaxinfer.device import matmul as device_matmul

    monkeypatch.setattr(device_matmul, "has_fp8_gemm", lambda layout: True)
    prompts = [[1, 5, 9, 33, 2, 7, 11], [3, 4]]
    kw = dict(mesh="tp=2", dtype="float32", quantization="fp8", attention_backend="xla", num_pages=16,
              max_tokens_per_step=16)
    llm = LLM(hf_tiny / "llama", **kw)
    try:
        fp8 = quantized_leaves(llm)
        assert fp8 and all(x.values.dtype == jnp.float8_e4m3fn for x in fp8)
        for x in fp8:
            a, c = x.lead, x.contract
            assert x.values.format.layout.major_to_minor == (*range(a), *range(a + c, x.ndim), *range(a, a + c))
            assert x.values.sharding.spec == llm.layout.sharding((*[None] * a, *x.axes)).spec
        logits = llm.logits(prompts)
        taken = jax.tree.leaves(llm.engine.runner.last["score"].input_formats[0][0])
        stored = jax.tree.leaves(jax.tree.map(lambda x: x.format, llm.weights))
        assert [f.layout for f in taken] == [f.layout for f in stored]
        # XLA:CPU's dot wants its weight row-major, so here (only) the program copies each of a layer's four
        # matmul weights back first: the copies the GPU check counts in the other direction on a GPU
        assert one_byte_copies(llm.engine.runner.last["score"].as_text())["count"] == 4
    finally:
        llm.close()
    monkeypatch.setattr(llm_module, "gemm_layouts", lambda weights, layout: weights)
    row_major = LLM(hf_tiny / "llama", **kw)
    try:
        assert all(x.values.format.layout.major_to_minor == tuple(range(x.ndim)) for x in quantized_leaves(row_major))
        np.testing.assert_allclose(np.concatenate(logits), np.concatenate(row_major.logits(prompts)), atol=1e-5,
                                   rtol=0)
        assert one_byte_copies(row_major.engine.runner.last["score"].as_text()) == {"count": 0, "bytes": 0}
    finally:
        row_major.close()


def test_metrics_and_json_report_the_quantization(tiny_llm, hf_tiny, capsys):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from jaxinfer import launch
    from jaxinfer.serve.metrics import EngineCollector

    llm = tiny_llm("llama", quantization="fp8")
    assert llm.quantization == {"weights": "fp8", "format": "on load", "activations": None}
    assert tiny_llm("llama").quantization is None
    registry = CollectorRegistry()
    registry.register(EngineCollector(llm.loop, "tiny"))
    samples = {s.name: s for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples}
    info = samples["jaxinfer:model_config_info"]
    assert info.value == 1 and info.labels == {"model_name": "tiny", "dtype": "float32", "quantization": "fp8"}

    assert launch.main(["--model", str(hf_tiny / "llama"), "--quantization", "int8", "--max-tokens", "2",
                        "--no-compilation-cache", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["quantization"] == {"weights": "int8", "format": "on load", "activations": None}
    assert r["parameter_bytes_per_device"] < tiny_llm("llama").parameter_bytes_per_device()
