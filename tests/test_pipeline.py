"""Pipeline parallel over pp (jaxinfer/device/pipeline.py): stages that do not divide evenly, mixed layer stacks,
the microbatches in flight across engine steps, the compiled step's communication, and the bubble count.
The fixtures' logits and greedy paths at pp layouts are in test_fixtures.py."""

import json

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.collectives import collective_report
from jaxinfer.device.pipeline import padding_slots, stage_bounds
from jaxinfer.random_model import DEFAULT, write_random_checkpoint
from jaxinfer.sharding import device_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TOL = 1e-4


@pytest.fixture(scope="module")
def llama_pp2(hf_tiny):
    return LLM(hf_tiny / "llama", mesh="pp=2", dtype="float32", max_tokens_per_step=64)


@pytest.fixture(scope="module")
def llama_one(hf_tiny):
    return LLM(hf_tiny / "llama", dtype="float32", max_tokens_per_step=64)


def mixed_prompts(n: int, seed: int = 0, longest: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(4, 260, size=int(rng.integers(2, longest))).tolist()] for _ in range(n)]


@pytest.mark.parametrize("layers, stages, sizes", [(5, 2, [3, 2]), (6, 4, [2, 2, 1, 1]), (4, 4, [1, 1, 1, 1])])
def test_stage_bounds_are_consecutive_and_as_even_as_they_can_be(layers, stages, sizes):
    bounds = stage_bounds(layers, stages)
    assert [len(b) for b in bounds] == sizes
    assert [i for b in bounds for i in b] == list(range(layers))


SMALL = {**DEFAULT, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16}
QWEN3_MOE = {**SMALL, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "moe_intermediate_size": 32,
             "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True}


@pytest.mark.parametrize("config, mesh", [
    ({**QWEN3_MOE, "num_hidden_layers": 5, "mlp_only_layers": [1]}, "pp=2,ep=2"),  # MoE 0 | dense 1 | MoE 2-4
    ({**SMALL, "num_hidden_layers": 6}, "pp=4"),                              # 2 + 2 + 1 + 1 layers
])
def test_uneven_stages_and_mixed_stacks_match_one_device(tmp_path, config, mesh):
    path = write_random_checkpoint(tmp_path / "model", config)
    one, pp = LLM(path, dtype="float32"), LLM(path, mesh=mesh, dtype="float32")
    if config.get("mlp_only_layers"):   # one stack per run of like layers; a dense one has no router
        assert [(s.first, s.size) for s in one.weights.layers] == [(0, 1), (1, 1), (2, 3)]
        assert [hasattr(s.weights.mlp, "router") for s in one.weights.layers] == [True, False, True]
    prompts = [[1, 20, 30, 40, 50, 60, 70], [1, 80, 90, 100, 110]]
    for a, b in zip(pp.logits(prompts), one.logits(prompts), strict=True):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert [c.token_ids for c in pp.generate(prompts, params)] == [c.token_ids for c in one.generate(prompts, params)]
    # each stage holds as many slots per stack as the fullest stage; the rest is padding (README: the cost)
    layers = config["num_hidden_layers"]
    assert padding_slots(pp.weights) == pp.weights.stage_layers * pp.layout.axis_size("layers") - layers > 0
    if pp.config.num_experts:   # counts come back per MoE layer, in model order, summed over the stages
        np.testing.assert_array_equal(pp.engine.expert_load.total, one.engine.expert_load.total)


def test_concurrent_requests_match_each_alone(llama_pp2, llama_one):
    prompts = mixed_prompts(16)
    together = llama_pp2.generate(prompts, GREEDY)
    alone = llama_pp2.generate([prompts[0]], GREEDY)[0]
    reference = llama_one.generate(prompts, GREEDY)
    assert together[0].token_ids == alone.token_ids
    assert [c.token_ids for c in together] == [c.token_ids for c in reference]
    pool = llama_pp2.engine.schedulers[0].pool
    assert pool.available == pool.num_pages and not llama_pp2.engine.has_unfinished()


def test_concurrent_requests_at_pp2_tp2_match_one_device(hf_tiny, llama_one):
    llm = LLM(hf_tiny / "llama", mesh="pp=2,tp=2", dtype="float32", max_tokens_per_step=64)
    prompts = mixed_prompts(16, seed=1)
    assert ([c.token_ids for c in llm.generate(prompts, GREEDY)]
            == [c.token_ids for c in llama_one.generate(prompts, GREEDY)])


def test_preemption_and_chunked_prefill_under_a_small_pool_lose_nothing(hf_tiny, llama_one):
    """6 pages of 16 tokens for 6 requests of up to 36 tokens, 16 tokens a step: requests are preempted and
    prompts are chunked, and every output is what one device gives."""
    llm = LLM(hf_tiny / "llama", mesh="pp=2", dtype="float32", num_pages=6, max_tokens_per_step=16)
    prompts = mixed_prompts(6, seed=2, longest=30)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats.preemptions > 0
    assert [c.token_ids for c in outs] == [c.token_ids for c in llama_one.generate(prompts, params)]
    pool = llm.engine.schedulers[0].pool
    assert pool.available == pool.num_pages == 6


def test_abort_in_flight_streaming_and_prefix_hits(llama_pp2, llama_one):
    engine = llama_pp2.engine
    prompt = mixed_prompts(1, seed=3)[0] * 2                     # long enough for a full cached page
    expected = llama_one.generate([prompt], GREEDY)[0].token_ids
    doomed = engine.add_request(mixed_prompts(1, seed=4)[0], GREEDY)
    engine.step()                                                # doomed is in flight ...
    assert engine.abort(doomed.id) and doomed.finish_reason == "abort"
    streamed = [token for token, _ in engine.stream(prompt, GREEDY)]  # ... and its token is dropped on return
    assert streamed == expected and doomed.output == []
    again = engine.add_request(prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert again.cached_tokens >= 16 and again.output == expected
    pool = engine.schedulers[0].pool
    assert pool.available == pool.num_pages


def test_utilisation_is_the_bubble_formula(llama_pp2):
    """P requests, one per in-flight slot, T tokens each: M = T x P microbatches fed back to back, so the stages
    do real work in exactly M of every M + P - 1 steps (N*M / (N*M + K*(P-1)) with N = K = 1)."""
    engine, P, T = llama_pp2.engine, 2, 5
    before = engine.stats.copy()
    llama_pp2.generate(mixed_prompts(P, seed=5), SamplingParams(temperature=0, max_tokens=T, ignore_eos=True))
    s = engine.stats - before
    M = T * P
    assert s.microbatches == M and s.steps == M + P - 1
    assert (s.busy_stage_steps, s.stage_steps) == (M * P, (M + P - 1) * P)
    assert s.utilisation == M / (M + P - 1)


def test_pp4_decode_step_moves_activations_once_and_holds_a_quarter_of_the_layers(hf_tiny):
    llm = LLM(hf_tiny / "llama", mesh="pp=4", dtype="float32")
    llm.generate([[1, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    report = collective_report(llm.engine.runner.last["decode"].as_text())
    hidden = llm.config.hidden_size
    # one collective-permute per step: [R=1, N=1 token, hidden] float32 from each stage to the next
    assert report["collective-permute"] == {"count": 1, "bytes": hidden * 4}
    # one all-reduce over pp (from the last stage) of the sampled token id and its log-probability [R, S, 2]
    # float32; nothing gathers weights
    assert report["all-reduce"] == {"count": 1, "bytes": 8}
    assert report["all-gather"]["count"] == report["all-to-all"]["count"] == 0
    w = llm.weights
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(w.layers))
    ends = sum(x.nbytes for x in jax.tree.leaves((w.embed, w.head)))          # replicated over pp
    for d in llm.layout.mesh.devices.flat:
        assert device_bytes(w, d) == layer_bytes // 4 + ends
    assert llm.engine.runner.cache.k.sharding.shard_shape(llm.engine.runner.cache.k.shape)[0] == 1


def test_idle_stages_under_sp_skip_their_layers_in_decode_and_run_them_in_ring_steps(hf_tiny, llama_one):
    """pp=2,sp=2: a decode step's stage runs its layers inside a conditional (an idle stage skips them; the
    all-gathers and all-to-alls of sharded-KV decode wait for their stage's group only), while a ring step
    keeps its collective-permutes outside any branch, where every device joins them; the tokens are one
    device's."""
    llm = LLM(hf_tiny / "llama", mesh="pp=2,sp=2", dtype="float32", max_tokens_per_step=32)
    prompts = mixed_prompts(2, seed=3)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [
        o.token_ids for o in llama_one.generate(prompts, GREEDY)]
    layers = llm.config.num_layers // 2                          # a stage's
    decode = llm.engine.runner.last["decode"].as_text()
    inside, always = collective_report(decode), collective_report(decode, branches=False)
    assert inside["all-gather"]["count"] == inside["all-to-all"]["count"] == layers
    assert always["all-gather"]["count"] == always["all-to-all"]["count"] == 0
    prefill = collective_report(llm.engine.runner.last["prefill"].as_text(), branches=False)
    assert prefill["collective-permute"]["count"] == layers + 1  # the ring's (sp - 1 per layer), the stages'
    llm.close()


def test_bad_pipeline_meshes_are_refused_before_anything_loads(tmp_path, hf_tiny):
    d = tmp_path / "cfg-only"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(json.loads((hf_tiny / "qwen2" / "config.json").read_text())))
    from jaxinfer.mesh import MeshError

    with pytest.raises(MeshError, match="pp=4 exceeds the model's 3 layers"):
        LLM(d, mesh="pp=4", dtype="float32")
    with pytest.raises(MeshError, match="needs 16 devices"):
        LLM(d, mesh="pp=2,tp=8", dtype="float32")
