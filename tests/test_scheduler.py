"""The scheduler of one replica on its own (no device): what it schedules, preemption order, admission under a
full pool, prefix-cache hits, and progress where pages are scarce. Sampled tokens are made up here."""

import numpy as np
import pytest

from jaxinfer.engine.page_pool import PagePool
from jaxinfer.engine.scheduler import Request, Scheduler
from jaxinfer.sampling import SamplingParams

P = 4  # tokens per page


def request(rid: str, prompt: list[int], budget: int, **params) -> Request:
    return Request(rid, list(prompt), SamplingParams(temperature=0, **params), seed=0, budget=budget,
                   stop_ids=frozenset())


def step(s: Scheduler, token: int = 7):
    """One step: schedule, 'run' it, feed a token to every sequence that samples. Returns (output, finished)."""
    out = s.schedule()
    return out, s.update(out, [token] * len(out.sequences))


def run(s: Scheduler, max_steps: int = 200) -> int:
    """Steps until nothing is queued; fails if a step schedules nothing while requests remain."""
    for n in range(max_steps):
        if not len(s):
            return n
        out, _ = step(s)
        assert out, f"stalled: {len(s.waiting)} waiting, {len(s.running)} running, {s.pool.available} pages free"
    raise AssertionError("did not finish")


def test_schedule_describes_the_work_plainly():
    s = Scheduler(PagePool(8, P), max_seqs=4, max_tokens=8)
    r = request("a", list(range(10, 21)), budget=2)                     # 11 prompt tokens
    s.add(r)
    first = s.schedule()
    [seq] = first.sequences
    assert (seq.request_id, seq.token_ids, seq.start, seq.end) == ("a", list(range(10, 18)), 0, 8)
    assert seq.pages.tolist() == [0, 1] and not seq.samples and seq.prefill          # a chunk of 8: budget
    assert s.update(first, [99]) == [] and r.output == []                   # nothing sampled mid-prompt
    second = s.schedule()
    [seq] = second.sequences
    assert (seq.token_ids, seq.start, seq.samples, seq.pages.tolist()) == (list(range(18, 21)), 8, True, [0, 1, 2])
    s.update(second, [5])
    [seq] = s.schedule().sequences                                          # a decode step
    assert (seq.token_ids, seq.start, seq.samples, seq.prefill) == ([5], 11, True, False)


def test_running_requests_go_first_and_share_the_budget():
    s = Scheduler(PagePool(32, P), max_seqs=8, max_tokens=8)
    a, b = request("a", [1] * 3, budget=4), request("b", [2] * 20, budget=2)
    s.add(a)
    step(s)                                                                 # a: prompt done, 1 token out
    s.add(b)
    out = s.schedule()
    assert [(q.request_id, len(q.token_ids)) for q in out.sequences] == [("a", 1), ("b", 7)]
    assert out.num_tokens == 8


def test_max_seqs_limits_admission():
    s = Scheduler(PagePool(32, P), max_seqs=2, max_tokens=64)
    for i in range(3):
        s.add(request(f"r{i}", [i + 1] * 2, budget=3))
    out = s.schedule()
    assert [q.request_id for q in out.sequences] == ["r0", "r1"] and [r.id for r in s.waiting] == ["r2"]
    assert len(s.waiting[0].pages) == 0


def test_newest_running_request_is_preempted_first_and_requeued_in_front():
    s = Scheduler(PagePool(6, P), max_seqs=8, max_tokens=64)
    old, mid, new = (request(n, [i + 1] * 7, budget=6) for i, n in enumerate(("old", "mid", "new")))
    late = request("late", [9] * 2, budget=1)
    for r in (old, mid, new):
        s.add(r)
    step(s)                                     # 3 x 7 prompt tokens: 2 pages each, the pool is full
    assert s.pool.available == 0
    s.add(late)
    out, _ = step(s)                            # each now holds 8 tokens; the 9th needs a third page
    assert s.preemptions == 0
    out, _ = step(s)
    assert s.preemptions == 1 and [r.id for r in s.running] == ["old", "mid"]
    assert list(s.waiting) == [new, late] and len(new.pages) == 0 and new.computed == 0
    assert [q.request_id for q in out.sequences] == ["old", "mid"]   # new's two pages went to them
    run(s)
    assert all(len(r.output) == r.budget for r in (old, mid, new, late))
    assert s.pool.available == 6


def test_a_request_that_is_not_admitted_holds_no_pages():
    """The cached prefix pages a waiting request looked up are returned when the rest does not fit."""
    s = Scheduler(PagePool(7, P), max_seqs=8, max_tokens=64)
    prefix = [3] * 8
    s.add(request("c", prefix + [4], budget=1))
    run(s)                                      # c's two full pages stay cached (evictable)
    assert s.pool.available == 7 and len(s.pool.evictable) == 2
    b = request("b", list(range(100, 116)), budget=8)
    s.add(b)
    step(s)                                     # b: 16 prompt tokens on 4 free pages, then decodes
    a = request("a", prefix + list(range(50, 60)), budget=2)
    s.add(a)
    step(s)                                     # b takes the last free page; a finds its 2 cached pages but
    assert list(s.waiting) == [a]               # not the 3 more it needs: it is not admitted ...
    assert len(a.pages) == 0 and a.computed == 0    # ... and holds nothing
    assert len(s.pool.evictable) == 2
    run(s)                                      # b is preempted later and must find pages: no stall
    assert len(b.output) == 8 and len(a.output) == 2 and s.pool.available == 7


def test_prefix_cache_hit_starts_after_the_cached_pages():
    s = Scheduler(PagePool(16, P), max_seqs=8, max_tokens=64)
    prompt = list(range(1, 11))                 # 10 tokens: 2 full pages
    s.add(request("first", prompt, budget=1))
    run(s)
    again = request("again", prompt + [42], budget=1)
    s.add(again)
    [seq] = s.schedule().sequences
    assert again.cached_tokens == 8 and seq.start == 8 and seq.token_ids == [9, 10, 42]
    assert s.pool.hits == 2


def test_a_fully_cached_prompt_recomputes_its_last_token():
    s = Scheduler(PagePool(16, P), max_seqs=8, max_tokens=64)
    prompt = list(range(1, 9))                  # exactly 2 pages
    s.add(request("first", prompt, budget=1))
    run(s)
    s.add(request("again", prompt, budget=1))
    [seq] = s.schedule().sequences
    assert seq.start == 4 and seq.token_ids == [5, 6, 7, 8] and seq.samples


def test_finish_and_abort_return_every_page():
    s = Scheduler(PagePool(8, P), max_seqs=8, max_tokens=64)
    a, b = request("a", [1] * 9, budget=50), request("b", [2] * 3, budget=2)
    s.add(a)
    s.add(b)
    step(s)
    assert s.pool.available == 8 - 3 - 1
    s.finish(a)                                 # an abort
    assert len(a.pages) == 0 and a not in s.running
    run(s)
    assert s.pool.available == 8


@pytest.mark.parametrize("max_tokens", [1, 3, 16])
def test_every_budget_serves_long_prompts(max_tokens):
    s = Scheduler(PagePool(16, P), max_seqs=4, max_tokens=max_tokens)
    reqs = [request(f"r{i}", [i + 1] * n, budget=3) for i, n in enumerate((1, 5, 13))]
    for r in reqs:
        s.add(r)
    run(s)
    assert [len(r.output) for r in reqs] == [3, 3, 3] and s.pool.available == 16


def test_reset_prefix_cache_frees_unreferenced_pages_and_forgets_keys():
    s = Scheduler(PagePool(8, P), max_seqs=8, max_tokens=64)
    prompt = list(range(1, 10))
    s.add(request("a", prompt, budget=1))
    run(s)
    assert len(s.pool.evictable) == 2
    s.pool.reset_prefix_cache()
    assert s.pool.evictable == {} and s.pool.cached == {} and len(s.pool.free) == 8
    s.add(request("b", prompt, budget=1))
    [seq] = s.schedule().sequences
    assert seq.start == 0 and s.pool.hits == 0


# ---- several microbatches in flight (a pipeline of `stages` stages) ----------------------------------------
def pipeline_run(s: Scheduler, stages: int, max_steps: int = 400) -> list[list[str]]:
    """Drive s as the engine does under pp: each step schedules one output, and the output scheduled
    stages - 1 steps earlier comes back. Returns the request ids of every output, in order."""
    in_flight, seen = [], []
    for _ in range(max_steps):
        if not len(s) and not any(in_flight):
            return seen
        out = s.schedule()
        seen.append([q.request_id for q in out.sequences])
        in_flight.append(out)
        if len(in_flight) == stages:
            done = in_flight.pop(0)
            s.update(done, [7] * len(done.sequences))
    raise AssertionError("did not finish")


def test_a_burst_is_spread_over_the_microbatches_in_flight():
    s = Scheduler(PagePool(64, P), max_seqs=16, max_tokens=64, stages=2)
    for i in range(8):
        s.add(request(f"r{i}", [1, 2, 3], budget=3))
    seen = pipeline_run(s, stages=2)
    assert [len(ids) for ids in seen[:2]] == [4, 4]          # not 8 then 0
    assert sorted(seen[0] + seen[1]) == [f"r{i}" for i in range(8)]
    work = [ids for ids in seen if ids]
    assert work == [seen[0], seen[1]] * 3                    # 3 tokens each: each half decodes in its own slot
    assert seen[:6] == work                                  # and no slot was left empty on the way


def test_a_request_waits_for_its_token_but_prompt_chunks_go_out_back_to_back():
    s = Scheduler(PagePool(64, P), max_seqs=4, max_tokens=4, stages=3)
    r = request("a", list(range(10, 20)), budget=2)          # 10 tokens: chunks of 4, 4, 2
    s.add(r)
    starts = [[q.start for q in s.schedule().sequences] for _ in range(4)]
    assert starts == [[0], [4], [8], []]                      # the last chunk samples: nothing until it is back
    assert r.scheduled == 10 and r.computed == 0 and r.pending == 0


def test_only_requests_with_nothing_in_flight_are_preempted():
    s = Scheduler(PagePool(6, P), max_seqs=8, max_tokens=16, stages=2)
    requests = [request(f"r{i}", [1 + i, 2, 3, 4, 5], budget=12) for i in range(4)]
    for r in requests:
        s.add(r)
    preempt, victims = s.preempt, []

    def checked(r):
        assert r.scheduled == r.computed, f"{r.id} preempted with tokens in flight"
        victims.append(r.id)
        preempt(r)

    s.preempt = checked
    pipeline_run(s, stages=2)
    assert victims and all(len(r.output) == 12 for r in requests)
    assert s.pool.available == 6


def test_a_request_aborted_in_flight_is_skipped_when_its_output_comes_back():
    s = Scheduler(PagePool(8, P), max_seqs=4, max_tokens=8, stages=2)
    a, b = request("a", [1, 2, 3], budget=2), request("b", [4, 5], budget=2)
    s.add(a)
    s.add(b)
    first = s.schedule()
    s.finish(a)
    a.finish_reason = "abort"
    assert s.update(first, [9]) == [] and a.output == []
    assert pipeline_run(s, stages=2) and b.output == [7, 7] and s.pool.available == 8


def step_with_prompt_logprobs(s: Scheduler) -> list:
    """One step whose made-up prompt log-probabilities ([tokens, 2 + 2K], K = 1) give target t the log-probability
    -t and rank 1. Returns the step's sequences."""
    out = s.schedule()
    targets = np.concatenate([q.prompt_targets if q.prompt_targets is not None else np.full(len(q.token_ids), -1)
                              for q in out.sequences] or [np.zeros(0)])
    rows = np.stack([-targets, np.ones_like(targets), targets, -targets], axis=-1).astype(np.float32)
    s.update(out, [7] * len(out.sequences), None, rows)
    return out.sequences


def test_prompt_logprobs_ask_each_position_once_and_skip_only_the_cached_pages_they_need():
    s = Scheduler(PagePool(16, P), max_seqs=4, max_tokens=8)
    prompt = list(range(10, 30))                                    # 20 tokens: 5 pages
    s.add(request("warm", prompt, budget=1))
    while len(s):
        step_with_prompt_logprobs(s)                                # the prompt's full pages are now cached
    r = request("a", prompt, budget=3, prompt_logprobs=1)
    s.add(r)
    [seq] = step_with_prompt_logprobs(s)
    assert (seq.start, r.cached_tokens) == (0, 0)                   # nothing from the cache: its logits are needed
    assert seq.prompt_targets.tolist() == prompt[1:9]               # each position asks for the next prompt token
    assert r.prompt_logprobs == [None] + [{t: -float(t)} for t in prompt[1:9]] and r.prompt_ranks[1:] == [1] * 8
    s.preempt(r)                  # readmitted: the cache serves the pages whose positions' entries are in, no more
    [seq] = step_with_prompt_logprobs(s)
    assert (seq.start, r.cached_tokens) == (2 * P, 2 * P) and seq.prompt_targets.tolist() == prompt[9:17]
    while r.finish_reason is None:
        seqs = step_with_prompt_logprobs(s)
    assert seqs[0].prompt_targets is None and not seqs[0].prefill   # a decode step asks nothing
    assert r.prompt_logprobs[1:] == [{t: -float(t)} for t in prompt[1:]] and len(r.output) == 3
