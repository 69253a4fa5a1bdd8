"""Numerics against the Hugging Face reference (../shared/fixtures/hf-tiny) on every layout we claim."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf-tiny"
TOL = 1e-4
MESHES = ["", "tp=2", "tp=4", "dp=2,tp=2", "dp=8"]
CASES = [(name, mesh) for name in ("llama", "llama3_scaled", "qwen2", "qwen3") for mesh in MESHES]
CASES += [("llama", "tp=8"), ("qwen2", "tp=8"), ("qwen3", "tp=8")]  # 8 heads: KV heads replicated
MOE_MESHES = ["", "ep=2", "ep=4", "ep=8", "ep=2,tp=2", "dp=2,ep=4", "ep=4,tp=2"]
CASES += [(name, mesh) for name in ("mixtral", "qwen3_moe") for mesh in MOE_MESHES]


def golden(name):
    g = np.load(FIXTURES / name / "golden.npz")
    prompts = [list(map(int, g["input_ids"][i, :n])) for i, n in enumerate(g["lengths"])]
    return prompts, g["logits"], g["greedy"]


def check_greedy_path(llm, prompt, path, reference_path):
    """Token by token: where we differ from the reference, the reference's logits must be near-tied."""
    if path == list(reference_path):
        return
    ours = llm.logits([prompt + path[:-1]])[0][len(prompt) - 1:]
    for t, (a, b) in enumerate(zip(path, reference_path, strict=True)):
        if a != b:
            assert abs(ours[t, a] - ours[t, b]) <= TOL, f"step {t}: {a} vs reference {b} not a near-tie"
            return


@pytest.mark.parametrize("name,mesh", CASES)
def test_logits_and_greedy_match_reference(name, mesh):
    prompts, ref_logits, ref_greedy = golden(name)
    llm = LLM(FIXTURES / name, mesh=mesh, dtype="float32")
    for i, logits in enumerate(llm.logits(prompts)):
        np.testing.assert_allclose(logits, ref_logits[i, : len(prompts[i])], atol=TOL, rtol=0)
    outs = llm.generate(prompts, SamplingParams(max_tokens=ref_greedy.shape[1], temperature=0, ignore_eos=True))
    for prompt, out, ref in zip(prompts, outs, ref_greedy, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == len(ref)
        check_greedy_path(llm, prompt, out.token_ids, ref)
    if llm.config.num_experts:  # the load report covers every MoE layer and expert
        load = np.asarray(llm.engine.expert_load.report()["total"]["tokens_per_expert"])
        assert load.shape == (len(llm.config.moe_layers), llm.config.num_experts)


def test_mistral_is_the_llama_block(tmp_path):
    """MistralForCausalLM checkpoints (no sliding window) load and run as the Llama block they are."""
    shutil.copytree(FIXTURES / "llama", tmp_path / "mistral")
    cfg = json.loads((tmp_path / "mistral" / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    (tmp_path / "mistral" / "config.json").write_text(json.dumps(cfg))
    prompts, ref_logits, _ = golden("llama")
    llm = LLM(tmp_path / "mistral", mesh="tp=2", dtype="float32")
    assert llm.config.architecture == "MistralForCausalLM"
    for i, logits in enumerate(llm.logits(prompts)):
        np.testing.assert_allclose(logits, ref_logits[i, : len(prompts[i])], atol=TOL, rtol=0)


def test_vocabulary_not_divisible_by_tp_is_padded(tmp_path):
    """A 270-token vocabulary at tp=4 is padded to 272 zero rows; outputs equal a single device's."""
    from jaxinfer.random_model import DEFAULT, write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "odd", {**DEFAULT, "vocab_size": 270, "num_hidden_layers": 2})
    single, sharded = LLM(path, dtype="float32"), LLM(path, mesh="tp=4", dtype="float32")
    assert sharded.engine.params["lm_head"].shape[-1] == 272
    ids = [[1, 5, 9, 269, 100], [1, 2]]
    for a, b in zip(single.logits(ids), sharded.logits(ids), strict=True):
        assert a.shape == b.shape == (a.shape[0], 270)
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.5, seed=3, ignore_eos=True)]
    for a, b in zip(single.generate(ids, params), sharded.generate(ids, params), strict=True):
        assert a.token_ids == b.token_ids and max(b.token_ids) < 270
