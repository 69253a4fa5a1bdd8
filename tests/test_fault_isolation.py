"""Fault isolation: a failure while a request is added, scheduled, packed, stepped on the device or handed its
tokens fails that request alone. Faults are injected from here (monkeypatching what the engine calls for one
marked request); concurrent requests must finish with the tokens they get alone, every page must come back, and
a later request must be served."""

import threading

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.loop import EngineDead
from jaxinfer.engine.scheduler import Request, Scheduler
from jaxinfer.sampling import SamplingArrays

MARK = 2**32 - 5   # the faulty request's seed (greedy: the seed changes nothing else); unseeded ones draw < 2**31
GREEDY = dict(temperature=0, ignore_eos=True)


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module", params=["overlap", "sync", "dp=2,tp=2", "pp=2"])
def llm(hf_tiny, request):
    """One device overlapped and not; two replicas overlapped; a pipeline of two stages."""
    mesh = request.param if "=" in request.param else ""
    return LLM(hf_tiny / "llama", mesh=mesh, dtype="float32", max_tokens_per_step=32,
               overlap=request.param != "sync")


def healthy() -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(7)
    return [(rng.integers(4, 384, size=n).tolist(), SamplingParams(max_tokens=m, **GREEDY))
            for n, m in [(3, 9), (20, 6), (45, 8), (9, 12)]]


@pytest.fixture(scope="module")
def alone(llm) -> list[list[int]]:
    return [llm.generate([p], params)[0].token_ids for p, params in healthy()]


def marked(r) -> bool:
    return r.params.seed == MARK


def faulty() -> tuple[list[int], SamplingParams]:
    return [1, 30, 31, 32, 33], SamplingParams(max_tokens=10, seed=MARK, **GREEDY)


def pool_is_whole(llm) -> bool:
    return all(s.pool.available == s.pool.num_pages and not s.running and not s.waiting for s in llm.engine.schedulers)


def run_with_fault(llm) -> tuple[list, BaseException | None]:
    """The healthy requests and the faulty one through the engine loop together: (healthy completions, the
    faulty request's error)."""
    prompts, params = zip(*healthy(), strict=True)
    p, sp = faulty()
    streams = llm.loop.submit_all([*prompts[:2], p, *prompts[2:]], [*params[:2], sp, *params[2:]])
    results, error = [], None
    for i, s in enumerate(streams):
        try:
            results.append(s.result())
        except Injected as e:
            assert i == 2, f"a healthy request failed: {e}"
            error = e
    return results, error


def fault_at(stage: str, m: pytest.MonkeyPatch, llm) -> None:
    """Make the marked request fail at `stage` once it has two tokens (mid-flight), or at once for "add"."""
    runner = llm.engine.runner
    if stage == "add":
        real_add = Scheduler.add
        m.setattr(Scheduler, "add", lambda self, r: (_ for _ in ()).throw(Injected("add")) if marked(r)
                  else real_add(self, r))
    elif stage == "admit":   # at its first scheduling
        real_lookup = Scheduler._lookup_prefix
        m.setattr(Scheduler, "_lookup_prefix", lambda self, r: (_ for _ in ()).throw(Injected("admit")) if marked(r)
                  else real_lookup(self, r))
    elif stage == "schedule":
        real_describe = Scheduler._describe

        def describe(self, r, n, index):
            if marked(r) and len(r.output) >= 2:
                raise Injected("schedule")
            return real_describe(self, r, n, index)
        m.setattr(Scheduler, "_describe", describe)
    elif stage == "pack":
        real_put = SamplingArrays.put

        def put(self, row, p, seed):
            if seed == MARK and p.max_tokens == 10 and put.calls > 2:
                raise Injected("pack")
            put.calls += seed == MARK
            return real_put(self, row, p, seed)
        put.calls = 0
        m.setattr(SamplingArrays, "put", put)
    elif stage in ("step", "device"):
        # "step": dispatching raises before the device takes the pool; "device": the step ran and took the
        # donated pool with it, and its outputs fail when collected (a device error)
        real_dispatch, real_collect, failing = runner.dispatch, runner.collect_step, []

        def dispatch(kind, batch, phase=None):
            has_mark = kind == "step" and MARK in np.asarray(batch.sampling.seed).tolist()
            dispatch.calls += has_mark
            if has_mark and dispatch.calls > 2 and stage == "step":
                raise Injected("step")
            out = real_dispatch(kind, batch, phase)
            if has_mark and dispatch.calls > 2:
                failing.append(out)   # kept alive, so no later output can take its id
                for x in jax.tree.leaves(runner.state):
                    x.delete()
            return out
        dispatch.calls = 0

        def collect_step(out):
            if any(out is x for x in failing):
                raise Injected("device")
            return real_collect(out)
        m.setattr(runner, "dispatch", dispatch)
        m.setattr(runner, "collect_step", collect_step)
    elif stage == "sample":   # handing out its tokens (stop checks, detokenizing, callbacks)
        real_token = Request.add_token

        def add_token(self, token, logprobs=None):
            if marked(self) and len(self.output) >= 2:
                raise Injected("sample")
            return real_token(self, token, logprobs)
        m.setattr(Request, "add_token", add_token)


@pytest.mark.parametrize("stage", ["add", "admit", "schedule", "pack", "step", "device", "sample"])
def test_a_fault_fails_its_request_alone(llm, alone, stage):
    runner, resets = llm.engine.runner, []
    with pytest.MonkeyPatch.context() as m:
        fault_at(stage, m, llm)
        real_reset = runner.reset_state
        m.setattr(runner, "reset_state", lambda: resets.append(1) or real_reset())
        results, error = run_with_fault(llm)
    assert isinstance(error, Injected) and str(error) == stage
    assert bool(resets) == (stage == "device")   # only a step that took the pool with it needs a new one
    assert [c.token_ids for c in results] == alone
    assert {c.finish_reason for c in results} == {"length"}
    assert pool_is_whole(llm) and not llm.engine.requests and llm.loop.dead is None
    p, params = healthy()[1]
    assert llm.generate([p], params)[0].token_ids == alone[1]   # and the engine serves on


def test_a_request_failing_at_admission_leaves_the_scheduler_as_if_it_never_came(llm):
    """Step by step, the scheduler's state (queues, each request's progress and pages, the pool's pages and
    references) with a request that fails at admission equals that of the same run without it."""
    engine = llm.engine

    def run(with_fault: bool) -> list:
        engine.reset_prefix_cache()
        states, requests = [], []
        for i, (p, params) in enumerate(healthy()[:3]):
            requests.append(engine.add_request(p, params, request_id=f"h{i}"))
            if i == 1 and with_fault:
                engine.add_request(*faulty(), request_id="bad")
            engine.step()
        while engine.has_unfinished():
            engine.step()
            s = engine.schedulers[0]
            states.append(([r.id for r in s.waiting], [(r.id, r.computed, r.scheduled, r.pages.tolist())
                                                         for r in s.running],
                           s.pool.is_free.tolist(), list(s.pool.refs), dict(s.pool.cached)))
        return states, [r.output for r in requests]

    clean = run(False)
    with pytest.MonkeyPatch.context() as m:
        fault_at("admit", m, llm)
        faulted = run(True)
    assert faulted == clean


def test_an_engine_that_cannot_recover_says_so(hf_tiny):
    """If restoring after a failed step fails too, the loop is dead: waiting callers get EngineDead, later
    submits are refused with it."""
    llm = LLM(hf_tiny / "llama", dtype="float32", max_tokens_per_step=16, num_pages=8)
    prompt = [1, 40, 41]
    assert llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))[0].token_ids
    runner = llm.engine.runner

    def broken(*args, **kwargs):
        for x in jax.tree.leaves(runner.state):
            x.delete()
        raise Injected("the device is gone")

    def no_memory():
        raise Injected("cannot allocate the pool")

    runner.dispatch, runner.reset_state = broken, no_memory
    errors = []

    def caller():
        try:
            llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))
        except EngineDead as e:
            errors.append(e)

    t = threading.Thread(target=caller, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive() and len(errors) == 1 and "cannot allocate the pool" in str(errors[0])
    assert isinstance(llm.loop.dead, Injected)
    with pytest.raises(EngineDead, match="could not recover"):
        llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))
