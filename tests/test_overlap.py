"""Overlapped scheduling (jaxinfer.engine.core): step k+1 is dispatched before step k's tokens reach the host, and
the tokens are exactly the synchronous loop's, whatever ends the requests."""

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams

MESHES = ["tp=1", "dp=2,tp=2", "pp=2"]


@pytest.fixture(scope="module", params=MESHES)
def pair(request, hf_tiny):
    """(synchronous, overlapped) tiny Llamas on one mesh, with few pages so that requests get preempted."""
    llms = [LLM(hf_tiny / "llama", mesh=request.param, dtype="float32", max_tokens_per_step=32, max_num_seqs=4,
                num_pages=5, overlap=overlap) for overlap in (False, True)]
    llms[1].engine.runner.executables = llms[0].engine.runner.executables   # the same programs: compile once
    yield llms
    for llm in llms:
        llm.close()


def workload(llm: LLM, golden) -> list[tuple[list[int], SamplingParams, int | None]]:
    """(prompt, params, abort after this many tokens): every way a request can end."""
    g = golden("llama")
    stop_token = g.greedy[0][15]                                   # the greedy output reaches it at token 16
    stop_text = llm.tokenizer.decode(g.greedy[1][2:4]).strip()     # and this text within its first tokens
    assert stop_token not in g.greedy[0][:15] and stop_text
    return [
        (g.prompts[0], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token]), None),
        (g.prompts[1], SamplingParams(max_tokens=24, temperature=0, stop=[stop_text]), None),
        (g.prompts[2], SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True), None),
        (g.prompts[3], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), 5),
        (g.prompts[0], SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True), None),
        (g.prompts[1], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), None),
    ]


def serve(llm: LLM, work) -> tuple[list[tuple[list[int], str]], int, int]:
    """Each request's (tokens, finish reason), the preemptions, and the tokens fed on device from the step
    before (placeholders the host could not fill)."""
    engine, fed = llm.engine, []
    dispatch = engine.runner.dispatch

    def counting(kind, batch, phase=None):
        fed.append(int((np.asarray(batch.feed) >= 0).sum()))
        return dispatch(kind, batch, phase)

    def abort_after(n):
        return lambda r, token, delta: len(r.output) == n and engine.abort(r.id)

    preempted = engine.stats.preemptions
    engine.runner.dispatch = counting
    try:
        requests = [engine.add_request(prompt, params, on_token=n and abort_after(n)) for prompt, params, n in work]
        while engine.has_unfinished():
            engine.step()
    finally:
        del engine.runner.dispatch
    return [(r.output, r.finish_reason) for r in requests], engine.stats.preemptions - preempted, sum(fed)


def test_overlapped_tokens_equal_the_synchronous_loops(pair, golden):
    sync, overlapped = pair
    work = workload(sync, golden)
    want, sync_preempted, sync_fed = serve(sync, work)
    got, preempted, fed = serve(overlapped, work)
    assert [reason for _, reason in want] == ["stop", "stop", "length", "abort", "length", "length"]
    assert len(want[0][0]) == 16 and len(want[3][0]) == 5 and len(want[5][0]) == 1
    assert got == want
    assert sync_preempted > 0 and preempted > 0          # the pool is too small for all of them at once
    assert sync_fed == 0 and fed > 0                      # only the overlapped loop ran ahead of the host
    assert not overlapped.engine.has_unfinished() and all(s.pool.available == s.pool.num_pages
                                                           for s in overlapped.engine.schedulers)


def test_generate_after_overlapped_requests_starts_clean(pair, golden):
    """Nothing is left in flight between calls: a second batch matches the synchronous loop too."""
    sync, overlapped = pair
    prompts = golden("llama").prompts
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert ([c.token_ids for c in overlapped.generate(prompts, params)]
            == [c.token_ids for c in sync.generate(prompts, params)])
