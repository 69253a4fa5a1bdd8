"""Generation mechanics: ragged batches, bucketing without recompilation, and the collective pattern."""

import re

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.packer import bucket

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_on(tiny_llm):
    """mesh -> the tiny Llama on that mesh, built once per session and mesh (tests/conftest.py)."""
    def get(mesh: str) -> LLM:
        return tiny_llm(mesh=mesh)
    return get


@pytest.fixture(scope="module")
def llama_tp4(llama_on):
    return llama_on("tp=4")


@pytest.fixture(scope="module")
def prompts(golden):
    return golden("llama").prompts


def test_batch_of_different_lengths_equals_each_alone(llama_tp4, prompts):
    sampled = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=7, ignore_eos=True)
    mixed = [GREEDY, sampled, GREEDY, sampled]
    together = llama_tp4.generate(prompts, mixed)
    for prompt, params, out in zip(prompts, mixed, together, strict=True):
        alone = llama_tp4.generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids and len(out.token_ids) == 8
        assert out.prompt_token_ids == prompt


def test_every_prompt_and_output_length_compiles_nothing_after_warm_up(llama_tp4, prompts):
    """Every prompt length 1..11 and output length 6..16, once to warm up, then again with other tokens."""
    def workload(source):
        for n in range(1, 12):
            out = llama_tp4.generate([source[:n]], SamplingParams(max_tokens=5 + n, temperature=0, ignore_eos=True))
            assert len(out[0].token_ids) == 5 + n

    workload(prompts[3])
    before = llama_tp4.engine.compilations
    workload(prompts[1])
    assert llama_tp4.engine.compilations == before


def collective_counts(report, kind):
    return report[kind]["count"], report[kind]["bytes"]


@pytest.mark.parametrize("mesh,batch", [("tp=4", 1), ("dp=2,tp=2", 4)])
def test_decode_step_has_two_all_reduces_per_layer(mesh, batch, prompts, llama_on):
    llm = llama_on(mesh)
    llm.generate(prompts[:batch], GREEDY)
    cfg, dp = llm.config, llm.mesh_config.dp
    rows, E, V, L, f32 = batch // dp, cfg.hidden_size, cfg.vocab_size, cfg.num_layers, 4
    decode, prefill = llm.collective_report()["decode"], llm.collective_report()["prefill"]
    # per layer: one all-reduce after attention, one after the MLP; outside: the vocabulary-parallel embedding
    assert collective_counts(decode, "all-reduce") == (2 * L + 1, (2 * L + 1) * rows * E * f32)
    tp = llm.mesh_config.tp
    if rows % tp:  # fewer rows than tp ranks: the vocabulary-parallel logits are gathered once, for the sampler
        assert collective_counts(decode, "all-gather") == (1, rows * V * f32)
        assert collective_counts(decode, "all-to-all") == (0, 0)
    else:  # each tp rank gets its share of the rows whole (one all-to-all), then the sampled ids are gathered
        assert collective_counts(decode, "all-to-all") == (1, rows // tp * V * f32)
        assert collective_counts(decode, "all-gather") == (1, rows * 4)
    for kind in ("collective-permute", "reduce-scatter"):
        assert collective_counts(decode, kind) == (0, 0)
    # prefill: each replica's prompts packed flat (requests alternate between replicas), padded to a bucket
    lengths = [len(p) for p in prompts[:batch]]
    N = next(n for n in llm.engine.packer.prefill_sizes if n >= bucket(max(sum(lengths[i::dp]) for i in range(dp))))
    assert collective_counts(prefill, "all-reduce") == (2 * L + 1, (2 * L + 1) * N * E * f32)


def test_each_tp_rank_filters_only_its_own_rows(llama_tp4, prompts):
    """The filters and the draw are split by rows over tp: four decoding sequences at tp=4, one row per
    rank; their prompt step's sequence slots (as many as its tokens may hold), a quarter per rank. No
    vocabulary-wide array (the logits a rank samples, the filters' ordered logits, the draw's random bits)
    holds more than a rank's rows, and on CPU the rows that draw go one at a time."""
    sampled = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True)
    llama_tp4.generate(prompts[:4], sampled)
    engine, V = llama_tp4.engine, llama_tp4.config.vocab_size
    prompt_step = next(n for n in engine.packer.prefill_sizes if n >= bucket(sum(map(len, prompts[:4]))))
    for step, slots in (("decode", 4), ("prefill", min(prompt_step, engine.packer.max_seqs))):
        text = engine.runner.last[step].as_text()
        rows = {int(n) for n in re.findall(rf"= \(?[fu]32\[(\d+),{V}\]", text)}
        assert rows and max(rows) == slots // 4, (step, rows)
        # the filters' and the draw's 32-bit words: one row at a time on CPU, so empty slots cost nothing
        assert set(re.findall(rf"= \(?u32\[(\d+),{V}\]", text)) == {"1"}, step


def test_chat_applies_template(llama_tp4):
    out = llama_tp4.chat([{"role": "user", "content": "Hi"}], GREEDY)[0]
    expected = llama_tp4.tokenizer.encode("<s>user: Hi</s><s>assistant:")
    assert out.prompt_token_ids == expected
    assert out.token_ids == llama_tp4.generate([expected], GREEDY)[0].token_ids
