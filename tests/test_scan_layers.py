"""The layer loop two ways: one lax.scan per layer stack (the default off CPU), or unrolled over one array
per layer and weight (the default on CPU, jaxinfer.layers.one_stack_per_layer). Same logits, same tokens."""

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams


@pytest.mark.parametrize("name, mesh", [("llama", "tp=2"), ("qwen3_moe", "ep=2")])
def test_unrolled_layers_match_the_scan(hf_tiny, golden, name, mesh):
    """qwen3_moe mixes dense and MoE layers (mlp_only_layers): several stacks when scanned."""
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
