"""Mixtral and Qwen3-MoE on expert-parallel layouts (their numerics against the reference: test_fixtures_moe.py;
dense and MoE layers mixed in one model, on pp=2,ep=2: test_pipeline.py)."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint import CheckpointError
from jaxinfer.mesh import MeshError


def test_decode_step_exchanges_tokens_by_two_all_to_alls_per_layer(hf_tiny, golden):
    llm = LLM(hf_tiny / "mixtral", mesh="ep=4", dtype="float32")
    prompts = golden("mixtral").prompts
    llm.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0))
    report, cfg = llm.collective_report()["decode"], llm.config
    L, E, k, f32 = cfg.num_layers, cfg.hidden_size, cfg.experts_per_token, 4
    n, ep = 1, 4                                          # one decode token per replica (bucket 1)
    C = n * k                                              # padded capacity per destination: nothing dropped
    assert report["all-to-all"]["count"] == 2 * L
    assert report["all-to-all"]["bytes"] == L * (ep * C * (E * f32 + 4) + ep * C * E * f32)
    assert report["all-gather"]["count"] == 0              # never expert weights (and tp=1: logits are whole)
    assert report["all-reduce"]["count"] == 0              # tp=1: nothing to reduce


def imbalance(tokens_per_expert) -> list[float]:
    """max / mean tokens per expert of each layer, computed here from the counts."""
    counts = np.asarray(tokens_per_expert, np.float64)
    return (counts.max(axis=1) / counts.mean(axis=1)).tolist()


def test_expert_load_counts_every_routed_token(hf_tiny, golden):
    llm = LLM(hf_tiny / "qwen3_moe", mesh="ep=2", dtype="float32")
    prompt = golden("qwen3_moe").prompts[1]
    llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    cfg = llm.config
    X, k, layers = cfg.num_experts, cfg.experts_per_token, len(cfg.moe_layers)
    assert llm.engine.stats.steps == 3                     # one prefill step, then two decode steps
    report = llm.engine.expert_load.report()
    total, last = report["total"], report["last_step"]
    assert np.shape(total["tokens_per_expert"]) == np.shape(last["tokens_per_expert"]) == (layers, X)
    # every computed token (the prompt, then the first two sampled ones) went to k experts in every layer;
    # padding (the prompt's bucket, the other ep replica's empty row) is not counted
    assert np.sum(total["tokens_per_expert"], axis=1).tolist() == [(len(prompt) + 2) * k] * layers
    assert np.sum(last["tokens_per_expert"], axis=1).tolist() == [k] * layers
    # the last step routed one token to k distinct experts: k of X experts hold 1, so max / mean = X / k
    assert np.max(last["tokens_per_expert"]) == 1
    assert last["imbalance"] == pytest.approx([X / k] * layers, rel=1e-12)
    for part in (total, last):
        assert part["imbalance"] == pytest.approx(imbalance(part["tokens_per_expert"]), rel=1e-12)


def test_llm_refuses_ep_that_does_not_divide_the_experts(hf_tiny):
    with pytest.raises(MeshError, match="ep=3 does not divide the model's 8 experts"):
        LLM(hf_tiny / "mixtral", mesh="ep=3", dtype="float32")


def test_dense_model_refuses_ep(hf_tiny):
    with pytest.raises(MeshError, match="expert parallel needs a mixture-of-experts model"):
        LLM(hf_tiny / "llama", mesh="ep=2", dtype="float32")


def test_missing_expert_tensor(tmp_path, hf_tiny):
    d = tmp_path / "mixtral"
    shutil.copytree(hf_tiny / "mixtral", d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    shard = d / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"lacks tensor 'model\.layers\.1\.block_sparse_moe\.experts\.5"):
        LLM(d, mesh="ep=2", dtype="float32")
