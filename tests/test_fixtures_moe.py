"""Numerics of the mixture-of-experts fixtures against the Hugging Face reference (../shared/fixtures/hf-tiny) on
every layout we claim for them, and the expert load the steps count (the dense models, and what the layouts
cover: test_fixtures.py)."""

import numpy as np
import pytest

from jaxinfer import LLM

TOL = 1e-4
MOE = {"mixtral": ["", "ep=8", "dp=2,ep=4", "sp=2"],
       "qwen3_moe": ["", "ep=2,tp=2"]}   # pp=2,ep=2: test_pipeline.py's mixed stacks, against one device
CASES = [(name, mesh) for name, meshes in MOE.items() for mesh in meshes]


@pytest.mark.parametrize("name,mesh", CASES)
def test_logits_and_greedy_match_reference(name, mesh, hf_tiny, golden, check_reference):
    reference = golden(name)
    prompts = reference.prompts
    llm = LLM(hf_tiny / name, mesh=mesh, dtype="float32")       # a fresh engine: its expert load is counted below
    new_tokens = check_reference(llm, reference, TOL)
    # Every token a step computed was routed to top_k experts in every MoE layer: all prompt tokens (fresh
    # engine: no prefix-cache hits) and the new_tokens - 1 decode inputs of each prompt (the last sampled
    # token is never fed back); padding is not counted.
    assert llm.config.num_experts
    computed = sum(len(p) for p in prompts) + len(prompts) * (new_tokens - 1)
    load = np.asarray(llm.engine.expert_load.report()["total"]["tokens_per_expert"])
    assert load.shape == (len(llm.config.moe_layers), llm.config.num_experts)
    assert load.sum(axis=1).tolist() == [computed * llm.config.experts_per_token] * len(llm.config.moe_layers)
