"""The paged engine: continuous batching, chunked prefill, preemption, prefix caching, abort, streaming."""

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.core import RequestError

GREEDY = dict(temperature=0, ignore_eos=True)


def workload(seed: int, n: int = 16) -> list[tuple[list[int], SamplingParams]]:
    """Mixed prompt lengths (1 to 100 tokens: decode-only to several prefill chunks) and output lengths (2 to
    11); the seed draws the tokens, so workloads of different seeds have the same shape."""
    rng, outputs = np.random.default_rng(seed), np.random.default_rng(100).integers(2, 12, size=16)
    lengths = [1, 5, 15, 16, 17, 33, 48, 64, 90, 100, 3, 9, 20, 31, 47, 70][:n]
    return [(rng.integers(4, 384, size=length).tolist(), SamplingParams(max_tokens=int(m), **GREEDY))
            for length, m in zip(lengths, outputs, strict=False)]


def serve(llm: LLM, requests, arrive_every: int = 2) -> dict[str, list[int]]:
    """Requests join while others run: one new request every `arrive_every` steps."""
    engine, pending, handles = llm.engine, list(enumerate(requests)), {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % arrive_every == 0:
            i, (prompt, params) = pending.pop(0)
            handles[i] = engine.add_request(prompt, params, request_id=f"r{i}")
        engine.step()
        step += 1
    return {i: r.output for i, r in handles.items()}


def alone(llm: LLM, requests) -> dict[int, list[int]]:
    return {i: llm.generate([p], params)[0].token_ids for i, (p, params) in enumerate(requests)}


@pytest.fixture(scope="module")
def llama(hf_tiny):
    return hf_tiny / "llama"


@pytest.fixture(scope="module")
def single(tiny_llm):
    return tiny_llm(max_tokens_per_step=32)


@pytest.fixture(scope="module")
def sharded(llama):
    return LLM(llama, mesh="dp=2,tp=2", dtype="float32", max_tokens_per_step=32)


def free_pages(llm: LLM) -> list[int]:
    return [r.pool.available for r in llm.engine.schedulers]


@pytest.mark.parametrize("which", ["single", "sharded"])
def test_concurrent_requests_equal_each_alone(which, request):
    llm = request.getfixturevalue(which)
    requests = workload(0)
    together = serve(llm, requests)
    assert together == alone(llm, requests)
    assert free_pages(llm) == [llm.engine.pages_per_replica] * len(llm.engine.schedulers)
    if which == "sharded":  # both replicas admitted prompts with full pages (each looked up its own cache)
        assert all(r.pool.queries > 0 for r in llm.engine.schedulers)


def test_replicas_share_the_requests(sharded):
    engine = sharded.engine
    requests, placed = [], []
    for i in range(4):
        r = engine.add_request([5 + i] * 3, SamplingParams(max_tokens=2, **GREEDY))
        requests.append(r)
        placed.append([s is engine.requests[r.id][1] for s in engine.schedulers].index(True))
    assert placed == [0, 1, 0, 1]                              # each to the least loaded replica
    while engine.has_unfinished():
        engine.step()
    assert [len(r.output) for r in requests] == [2] * 4


def test_preemption_recomputes_and_loses_nothing(single, llama):
    requests = workload(1, n=10)
    expected = alone(single, requests)
    tiny = LLM(llama, dtype="float32", max_tokens_per_step=32, num_pages=12)   # 192 tokens of KV
    got = serve(tiny, requests, arrive_every=1)
    assert tiny.engine.stats.preemptions > 0
    assert got == expected
    assert free_pages(tiny) == [12]


def test_prefix_cache_reuses_three_pages(single, llama):
    rng = np.random.default_rng(7)
    prefix = rng.integers(4, 384, size=48).tolist()
    first, second = prefix + [11, 12, 13], prefix + [21, 22]
    params = SamplingParams(max_tokens=6, **GREEDY)
    uncached = LLM(llama, dtype="float32", prefix_caching=False)
    pool = single.engine.schedulers[0].pool
    single.generate([first], params)
    hits = pool.hits
    out = single.generate([second], params)[0]
    assert pool.hits - hits == 3                               # 48 tokens = three full pages of 16
    assert out.token_ids == uncached.generate([second], params)[0].token_ids
    assert uncached.engine.schedulers[0].pool.hits == 0


def test_a_fully_cached_prompt_still_computes_its_last_token(single):
    prompt = np.random.default_rng(8).integers(4, 384, size=32).tolist()   # exactly two pages
    params = SamplingParams(max_tokens=4, **GREEDY)
    a = single.generate([prompt], params)[0].token_ids
    pool, hits = single.engine.schedulers[0].pool, single.engine.schedulers[0].pool.hits
    b = single.generate([prompt], params)[0].token_ids
    assert a == b and pool.hits - hits == 1                     # the page holding the last token is recomputed


def test_abort_returns_pages_at_once(single):
    engine = single.engine
    total = engine.pages_per_replica
    r = engine.add_request(list(range(4, 60)), SamplingParams(max_tokens=100, **GREEDY))
    other = engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    engine.step()
    assert free_pages(single)[0] < total and len(r.pages)
    assert engine.abort(r.id) and r.finish_reason == "abort"
    assert not engine.abort(r.id)                               # unknown now
    while engine.has_unfinished():
        engine.step()
    assert other.finish_reason == "length" and len(other.output) == 3
    assert free_pages(single)[0] == total


def test_continuous_batching_compiles_nothing_after_warm_up(single):
    serve(single, workload(2))
    before = single.engine.compilations
    serve(single, workload(3))                                  # same shape of workload, other tokens
    assert single.engine.compilations == before


def test_refused_requests_leave_the_others_running(single, llama):
    engine = single.engine
    ok = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    with pytest.raises(RequestError, match="context limit of 512"):
        engine.add_request(list(np.full(600, 9)), SamplingParams(max_tokens=4))
    small = LLM(llama, dtype="float32", num_pages=4)   # 64 tokens of KV
    with pytest.raises(RequestError, match="KV page pool of 64 tokens"):
        small.engine.add_request(list(np.full(100, 9)), SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    assert ok.finish_reason == "length" and len(ok.output) == 4


def test_streaming_yields_tokens_as_produced(single):
    prompt, params = [1, 88, 86, 265], SamplingParams(max_tokens=7, **GREEDY)
    streamed = list(single.engine.stream(prompt, params))
    assert [t for t, _ in streamed] == single.generate([prompt], params)[0].token_ids
    seen = []
    r = single.engine.add_request(prompt, params, on_token=lambda req, tok, delta: seen.append(tok))
    while single.engine.has_unfinished():
        single.engine.step()
    assert seen == r.output


def test_pallas_backend_in_interpret_mode_matches_xla(hf_tiny, golden):
    """The Pallas kernels (interpret mode on CPU) inside the real engine give the same tokens and logits.
    qwen3: head_dim 16, the smallest the Triton kernel takes."""
    kw = dict(mesh="tp=2", dtype="float32", max_tokens_per_step=32)
    pallas = LLM(hf_tiny / "qwen3", attention_backend="pallas", **kw)
    xla = LLM(hf_tiny / "qwen3", attention_backend="xla", **kw)
    assert (pallas.engine.runner.backend, xla.engine.runner.backend) == ("pallas", "xla")
    requests = workload(4, n=3)
    assert alone(pallas, requests) == alone(xla, requests)
    g = golden("qwen3")
    ids = g.prompts[1]
    np.testing.assert_allclose(pallas.logits([ids])[0], g.logits[1, : len(ids)], atol=1e-4, rtol=0)


def test_cpu_kernel_in_the_engine_gives_the_references_tokens(sharded, llama, golden):
    """The C++ kernel (the CPU default) against the jnp reference in the same engine at dp=2, tp=2: the same
    tokens for a mixed workload served with requests joining, and the checkpoint's reference logits."""
    xla = LLM(llama, mesh="dp=2,tp=2", dtype="float32", max_tokens_per_step=32, attention_backend="xla")
    assert (sharded.engine.runner.backend, xla.engine.runner.backend) == ("cpu", "xla")
    requests = workload(5)
    assert serve(sharded, requests) == serve(xla, requests)
    g = golden("llama")
    ids = g.prompts[1]
    np.testing.assert_allclose(sharded.logits([ids])[0], g.logits[1, : len(ids)], atol=1e-4, rtol=0)


def test_pallas_backend_refuses_shapes_it_cannot_tile(llama):
    with pytest.raises(ValueError, match="head_dim 8"):        # the llama fixture: head_dim 8
        LLM(llama, dtype="float32", attention_backend="pallas")
    with pytest.raises(ValueError, match="not one of xla, cpu, pallas"):
        LLM(llama, dtype="float32", attention_backend="cuda")
