"""The decode step compiled for an H100 on this CPU machine (jaxinfer.device.gpu_target): what it writes per
step (jaxinfer.bench.hlo_writes) and how its GEMMs read quantized weights.

A decode step reads each weight once; a weight dequantized before its GEMM (XLA:GPU wrote a bfloat16 copy of
every int8 weight on every step), transposed for the GEMM (every fp8 weight at batch 1), or a matrix-vector
product materialised is a weight-sized array written and read back per step. The model has Llama-3-8B's
layer shapes (XLA keeps GEMMs of 10M elements and more as GEMMs at batch 1) and two layers; nothing is
allocated, the engine compiles on the weights' shapes.
"""

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.bench.gpu_compile import gemms
from jaxinfer.bench.gpu_compile import main as gpu_compile_main
from jaxinfer.bench.hlo_writes import written_arrays
from jaxinfer.config import EngineConfig
from jaxinfer.device.gpu_target import compile_only_gpus
from jaxinfer.mesh import MeshConfig
from jaxinfer.models import config_from_dict
from jaxinfer.plan.compiled import decode_shape, layout_engine, step_program
from jaxinfer.quant import QuantArray
from jaxinfer.quant_formats import StoredQuantization
from jaxinfer.random_model import BENCH_MOE_100M, LLAMA3_8B

HLO = """HloModule m

%fused_double (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %a = f32[1024]{0} add(%p, %p)
}

%body (t: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %t = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[1024]{0} get-tuple-element(%t), index=1
  %loop_add_fusion = f32[1024]{0} fusion(%x), kind=kLoop, calls=%fused_double
  ROOT %r = (s32[], f32[1024]{0}) tuple(%i, %loop_add_fusion)
}

%cond (t: (s32[], f32[1024])) -> pred[] {
  %t = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%small (x: f32[1024]) -> f32[2] {
  %x = f32[1024]{0} parameter(0)
  ROOT %s = f32[2]{0} slice(%x), slice={[0:2]}
}

%big (x: f32[1024]) -> f32[2] {
  %x = f32[1024]{0} parameter(0)
  %c = f32[1024]{0} copy(%x)
  ROOT %s = f32[2]{0} slice(%c), slice={[0:2]}
}

ENTRY %main (x: f32[1024], pool: f32[65536], b: s32[]) -> (f32[2], f32[65536]) {
  %x = f32[1024]{0} parameter(0)
  %pool = f32[65536]{0} parameter(1)
  %b = s32[] parameter(2)
  %z = s32[] constant(0)
  %init = (s32[], f32[1024]{0}) tuple(%z, %x)
  %w = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body
  %y = f32[1024]{0} get-tuple-element(%w), index=1
  %k = f32[2]{0} conditional(%b, %y, %y), branch_computations={%small, %big}
  %loop_dynamic_update_slice_fusion = f32[65536]{0} fusion(%pool, %k), kind=kLoop, calls=%fused_double
  ROOT %out = (f32[2]{0}, f32[65536]{0}) tuple(%k, %loop_dynamic_update_slice_fusion)
}
"""


def test_writes_count_loops_times_trips_the_larger_branch_and_no_in_place_update():
    writes = written_arrays(HLO)
    assert writes == {("loop_add_fusion", "f32[1024]"): 3 * 4096,      # a while body, 3 trips
                      ("c", "f32[1024]"): 4096, ("s", "f32[2]"): 8}      # the larger branch, once


@pytest.fixture(scope="module")
def h100():
    return compile_only_gpus("H100")


@pytest.fixture(scope="module")
def cfg():
    return dataclasses.replace(config_from_dict({**LLAMA3_8B, "vocab_size": 32000}), num_layers=2)


@pytest.mark.parametrize(("quantization", "batches"), [(None, (1,)), ("int8", (32,)), ("fp8", (1,))])
def test_decode_on_an_h100_writes_no_weight_sized_array(h100, cfg, quantization, batches):
    """No array written per step is as large as the smallest matmul weight, and every quantized GEMM reads
    its weight's 1-byte values (the conversion inside the GEMM): int8 at batch 32 (its dequantized copy was
    written at every batch), fp8 at batch 1 (its transposes were there)."""
    config = EngineConfig(quantization=quantization, attention_backend="pallas")
    engine = layout_engine(cfg, MeshConfig(), jnp.bfloat16, config, max(batches), h100)
    leaves = jax.tree.leaves([s.weights for s in engine.runner.weights.layers],
                             is_leaf=lambda x: isinstance(x, QuantArray))
    arrays = [x.values if isinstance(x, QuantArray) else x for x in leaves]
    smallest = min(math.prod(x.shape) * x.dtype.itemsize for x in arrays if len(x.shape) >= 3)   # not the norms
    for batch in batches:
        hlo = step_program(engine, decode_shape(engine, batch)).as_text()
        writes = written_arrays(hlo)
        assert max(writes.values()) < smallest, writes.most_common(2)
        assert gemms(hlo)[1] == (0 if quantization is None else 4 * cfg.num_layers)   # qkv, o, gate_up, down


def test_a_block_wise_fp8_checkpoint_on_an_h100_reads_each_weight_once(h100, cfg):
    """DeepSeek-style fp8 in 128x128 blocks: each matmul is one call of the Pallas kernel, which scales each
    block's product as it accumulates. No write as large as the smallest weight at batch 32 (XLA's products
    per block wrote [32 blocks, 32 rows, 28672] float32 for gate/up, 112 MiB)."""
    stored = StoredQuantization("fp8", "fp8", "_scale_inv", 128, 128, "dynamic")
    engine = layout_engine(cfg, MeshConfig(), jnp.bfloat16, EngineConfig(), 32, h100, stored)
    layers = [s.weights for s in engine.runner.weights.layers]
    quantized = [x for x in jax.tree.leaves(layers, is_leaf=lambda x: isinstance(x, QuantArray))
                 if isinstance(x, QuantArray)]
    assert {q.scale.shape[1] for q in quantized} == {32, 112}     # blocks of 4096 and 14336 rows
    smallest = min(math.prod(q.shape) for q in quantized)
    hlo = step_program(engine, decode_shape(engine, 32)).as_text()
    writes = written_arrays(hlo)
    assert max(writes.values()) < smallest, writes.most_common(2)
    kernels = [line for line in hlo.splitlines() if "__gpu$xla.gpu.triton" in line and "jit(block_matmul)" in line]
    assert len(kernels) == 4 * cfg.num_layers   # qkv, o, gate_up, down


def test_blocks_a_tp_split_cuts_are_dequantized_where_they_are(cfg):
    """Blocks of 96 rows (a partial last one in 4096): tp=2 splits the down projection's 14336 rows at 7168,
    inside a block. Cut into blocks as one product, the weight's rows would travel between the GPUs on every
    step (XLA all-gathered 34 MB of them); dequantized on each GPU instead, only activations travel."""
    from jaxinfer.collectives import collective_report

    stored = StoredQuantization("fp8", "fp8", "_scale_inv", 128, 96, "dynamic")
    engine = layout_engine(cfg, MeshConfig(tp=2), jnp.bfloat16, EngineConfig(), 1, compile_only_gpus("H100", 2),
                           stored)
    report = collective_report(step_program(engine, decode_shape(engine, 1)).as_text())
    assert report["all-gather"]["bytes"] < 1 << 20, report


@pytest.mark.parametrize(("quantization", "batch", "experts"), [(None, 8, 8), ("fp8", 1, 128)])
def test_experts_on_an_h100_are_read_as_stored(h100, quantization, batch, experts):
    """Each of the experts' products is one call of the grouped matmul kernel, which reads the experts the rows
    chose where they lie: no array as large as one expert's gate/up weight is written per step (XLA's
    ragged_dot wrote [experts, rows, K] masked copies of the rows, 955 MiB per step for Qwen3-30B-A3B's 4 first
    layers at batch 32; dequantized first, every quantized expert was copied in bfloat16 each step). The router's
    product is a GEMM too: one row's, strength-reduced, wrote [embed, experts] in float32 (2 MiB at 128 experts)."""
    moe = dataclasses.replace(config_from_dict({**BENCH_MOE_100M, "hidden_size": 4096, "intermediate_size": 2048,
                                                "num_attention_heads": 32, "num_key_value_heads": 8,
                                                "num_local_experts": experts}),
                              num_layers=1)   # attention at 8B's width: its one-row products stay GEMMs
    engine = layout_engine(moe, MeshConfig(), jnp.bfloat16, EngineConfig(quantization=quantization), batch, h100)
    gate_up = engine.runner.weights.layers[0].weights.mlp.gate_up
    gate_up = gate_up.values if isinstance(gate_up, QuantArray) else gate_up   # [1, X, E, G, 2M/G]
    one_expert = math.prod(gate_up.shape[2:]) * gate_up.dtype.itemsize
    hlo = step_program(engine, decode_shape(engine, batch)).as_text()
    writes = written_arrays(hlo)
    assert max(writes.values()) < one_expert, writes.most_common(2)
    router = f"{moe.hidden_size},{moe.num_experts}]"
    assert not [shape for _, shape in writes if router in shape], writes.most_common(2)
    kernels = [line for line in hlo.splitlines() if "__gpu$xla.gpu.triton" in line and "grouped_matmul" in line]
    assert len(kernels) == 2   # gate/up and down
    rows = [re.search(r"operand_layout_constraints=\{s32\[[\d,]+\]\{[\d,]+\}, (\w+)\[", k).group(1) for k in kernels]
    assert rows == ["f8e4m3fn" if quantization == "fp8" else "bf16"] * 2   # fp8 experts: on fp8 activations
    assert gemms(hlo)[1] == (0 if quantization is None else 2)   # 1-byte: qkv and o


def test_the_command_reports_each_variant(capsys):
    """On an A100 too (no fp8 there, but int8 is converted inside its GEMMs)."""
    assert gpu_compile_main(["--layers", "1", "--batch", "1", "--quantization", "int8", "--gpu", "A100",
                             "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert (row["quantization"], row["batch"], row["one_byte_gemms"]) == ("int8", 1, 4)
    assert 0 < row["written_bytes"] < row["weight_bytes_per_device"] / 100


def test_an_unknown_gpu_is_refused():
    with pytest.raises(ValueError, match="unknown GPU 'V100'"):
        compile_only_gpus("V100")
