"""The layer loop two ways: one lax.scan per layer stack, or over one array per layer and weight
(jaxinfer.device.layers.one_stack_per_layer and switched_layers; the default on CPU for large layers). Same
logits, same tokens."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.device.layers import UNROLL_LAYER_BYTES, LayerStack, StepContext, layer_bytes, run_layers
from jaxinfer.engine.scheduler import SchedulerOutput
from jaxinfer.random_model import DEFAULT


@pytest.mark.parametrize("name, mesh", [("llama", "tp=2"), ("qwen3_moe", "ep=2")])
def test_unrolled_layers_match_the_scan(hf_tiny, golden, name, mesh):
    """qwen3_moe: MoE layers, their experts stacked per layer either way."""
    prompts = golden(name).prompts[:2]
    runs = {scan: LLM(hf_tiny / name, mesh=mesh, dtype="float32", num_pages=16, scan_layers=scan)
            for scan in (True, False)}
    layers = runs[True].config.num_layers
    scanned, unrolled = runs[True].weights.layers, runs[False].weights.layers
    assert sum(s.size for s in scanned) == layers and len(scanned) < layers
    assert [(s.first, s.size) for s in unrolled] == [(i, 1) for i in range(layers)]

    want, got = (runs[scan].logits(prompts) for scan in (True, False))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want, got = ([o.token_ids for o in runs[scan].generate(prompts, params)] for scan in (True, False))
    assert got == want
    if name == "qwen3_moe":   # every layer's routed tokens, in layer order, either way
        loads = [runs[scan].engine.expert_load.report()["total"]["tokens_per_expert"] for scan in (True, False)]
        np.testing.assert_array_equal(loads[1], loads[0])
    for llm in runs.values():
        llm.close()


def test_unrolled_layers_refuse_a_pipeline(hf_tiny):
    with pytest.raises(ValueError, match="scan_layers=False needs pp=1"):
        LLM(hf_tiny / "llama", mesh="pp=2", dtype="float32", scan_layers=False)


def test_default_unrolls_only_layers_larger_than_the_caches(hf_tiny):
    """The default unrolls a model whose layers hold more than UNROLL_LAYER_BYTES of weights and scans a
    smaller one, whose compile time would cost more than the scan's copies."""
    small = LLM(hf_tiny / "llama", dtype="float32", num_pages=4)
    assert layer_bytes(small.weights, small.dtype) < UNROLL_LAYER_BYTES
    assert len(small.weights.layers) == 1
    wide = {**DEFAULT, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 2}
    big = LLM.random(wide, dtype="float32", num_pages=4, compilation_cache=False)
    assert layer_bytes(big.weights, big.dtype) > UNROLL_LAYER_BYTES
    assert [s.size for s in big.weights.layers] == [1, 1]
    for llm in (small, big):
        llm.close()


def weight_shaped_arrays(llm: LLM) -> list[str]:
    """Arrays of a layer weight's shape that a decode step's optimized program makes: copies of weights."""
    engine = llm.engine
    batch = engine.packer.pack([SchedulerOutput([])], (2, 2))
    program = engine.runner.compile("step", batch).as_text()
    shapes = {",".join(map(str, a.shape[1:])) for s in llm.weights.layers for a in jax.tree.leaves(s.weights)
              if a.ndim > 2}
    made = re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} (?:copy|dynamic-slice|fusion|gather)\(", program)
    return [shape for shape in made if shape in shapes]


def test_layers_of_their_own_read_their_weights_in_place(hf_tiny):
    """The scan copies (some of) a layer's weights out of the stack; one array per layer needs no copy."""
    copies = {}
    for scan in (True, False):
        llm = LLM(hf_tiny / "llama", dtype="float32", num_pages=8, scan_layers=scan)
        copies[scan] = weight_shaped_arrays(llm)
        llm.close()
    assert copies[True] and not copies[False]


def test_a_layer_must_call_attention_once():
    stacks = tuple(LayerStack({"w": jnp.ones((1, 4, 4))}, first=i) for i in range(2))
    ctx = StepContext(None, None, "xla", attend=lambda q, k, v, cache, layer, inv_freq: (q, cache))

    def layer(calls):
        def run(w, x, cache, i, ctx):
            for _ in range(calls):
                x, cache = ctx.attention(x @ w["w"], x, x, cache, i, None)
            return x, cache, None
        return run

    x = jnp.ones((3, 4))
    out, _, _ = run_layers(layer(1), stacks, x, None, ctx)
    np.testing.assert_allclose(out, x @ np.ones((4, 4)) @ np.ones((4, 4)))
    for calls, said in ((0, "did not call it"), (2, "called it 2 times")):
        with pytest.raises(ValueError, match=f"a layer must call ctx.attention once; this one {said}"):
            run_layers(layer(calls), stacks, x, None, ctx)
