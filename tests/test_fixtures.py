"""Numerics against the Hugging Face reference (../shared/fixtures/hf-tiny) on every layout we claim: the dense
models here, the mixture-of-experts models in test_fixtures_moe.py (two files, so that each xdist worker can take
one)."""

import json
import shutil

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams

TOL = 1e-4
# Every axis and the mixes that meet in one program (dp with tp, pp with sp and tp, dp with pp and sp) are checked
# against the reference by at least one dense and (for ep) one MoE model (MOE in test_fixtures_moe.py), and every
# model on one device and at least one layout where it differs (rope scaling and a bf16 tied checkpoint,
# biases, q/k norm, routing). Pipelines: llama's 4 layers split evenly over pp=2 and pp=4; the 3-layer models
# unevenly over pp=2 (2 + 1: one padding slot). Sequence parallel: every dense model at one sp layout at least
# (sp=4: test_sequence_parallel.py), and one MoE model.
DENSE = {"llama": ["", "tp=2", "dp=8", "pp=4", "dp=2,pp=2,sp=2"],
         "llama3_scaled": ["", "dp=2,tp=2", "sp=2,tp=2"],
         "qwen2": ["", "tp=8", "pp=2", "dp=2,sp=2"],    # tp=8 > KV heads: replicated
         "qwen3": ["", "pp=2,sp=2,tp=2"]}          # q/k norm over heads split by tp
CASES = [(name, mesh) for name, meshes in DENSE.items() for mesh in meshes]


@pytest.mark.parametrize("name,mesh", CASES)
def test_logits_and_greedy_match_reference(name, mesh, golden, tiny_llm, check_reference):
    # the session's model (tests/conftest.py): other modules may serve the same one
    check_reference(tiny_llm(name, mesh), golden(name), TOL)


def test_pages_smaller_than_a_kernel_tile_match_reference(hf_tiny, golden, check_greedy_path):
    """Pages of 8 tokens, half the CPU attention kernel's 16-key tile (the default backend here): prompts of
    up to 47 tokens span six pages, and 24 new tokens three more."""
    prompts, ref_logits, ref_greedy, _ = golden("llama")
    llm = LLM(hf_tiny / "llama", dtype="float32", page_size=8)
    for i, logits in enumerate(llm.logits(prompts)):
        np.testing.assert_allclose(logits, ref_logits[i, : len(prompts[i])], atol=TOL, rtol=0)
    outs = llm.generate(prompts, SamplingParams(max_tokens=len(ref_greedy[0]), temperature=0, ignore_eos=True))
    for prompt, out, ref in zip(prompts, outs, ref_greedy, strict=True):
        check_greedy_path(llm, prompt, out.token_ids, ref)


def test_mistral_is_the_llama_block(tmp_path, hf_tiny, golden):
    """MistralForCausalLM checkpoints (no sliding window) load and run as the Llama block they are."""
    shutil.copytree(hf_tiny / "llama", tmp_path / "mistral")
    cfg = json.loads((tmp_path / "mistral" / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    (tmp_path / "mistral" / "config.json").write_text(json.dumps(cfg))
    prompts, ref_logits = golden("llama")[:2]
    llm = LLM(tmp_path / "mistral", mesh="tp=2", dtype="float32")
    assert llm.config.architecture == "MistralForCausalLM"
    for i, logits in enumerate(llm.logits(prompts)):
        np.testing.assert_allclose(logits, ref_logits[i, : len(prompts[i])], atol=TOL, rtol=0)


def test_vocabulary_not_divisible_by_tp_is_padded(tmp_path):
    """A 270-token vocabulary at tp=4 is padded to 272 zero rows; outputs equal a single device's."""
    from jaxinfer.random_model import DEFAULT, write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "odd", {**DEFAULT, "vocab_size": 270, "num_hidden_layers": 2})
    single, sharded = LLM(path, dtype="float32"), LLM(path, mesh="tp=4", dtype="float32")
    lm_head, table = np.asarray(sharded.weights.head.lm_head), np.asarray(sharded.weights.embed.table)
    assert lm_head.shape[1] == table.shape[0] == 272                             # lm_head [E, V], table [V, E]
    assert not lm_head[:, 270:].any() and not table[270:].any()                  # the padding rows are zeros
    np.testing.assert_array_equal(lm_head[:, :270], np.asarray(single.weights.head.lm_head))
    ids = [[1, 5, 9, 269, 100], [1, 2]]
    for a, b in zip(single.logits(ids), sharded.logits(ids), strict=True):
        assert a.shape == b.shape == (a.shape[0], 270)
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.5, seed=3, ignore_eos=True)]
    for a, b in zip(single.generate(ids, params), sharded.generate(ids, params), strict=True):
        assert a.token_ids == b.token_ids and max(b.token_ids) < 270
