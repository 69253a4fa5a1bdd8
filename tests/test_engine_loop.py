"""The engine loop's contract with its callers: configuration and requests checked before anything is queued,
request ids, a stalled engine reported instead of spinning, and the launcher's flags checked before loading."""

import dataclasses
import threading
import time

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, launch
from jaxinfer.config import EngineConfig
from jaxinfer.engine.core import EngineStalled, RequestError

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llm):
    """The one-device Llama other modules share (its 64-token budget changes nothing checked here)."""
    return tiny_llm(max_tokens_per_step=64)


@pytest.mark.parametrize("field, value, says", [
    ("max_num_seqs", 0, "max_num_seqs=0 must be an integer >= 1"),
    ("max_tokens_per_step", 0, "max_tokens_per_step=0"),
    ("page_size", 12, "page_size=12 must be a power of two"),
    ("page_size", 0, "page_size=0"),
    ("num_pages", 0, "num_pages=0"),
    ("memory_fraction", 0.0, "memory_fraction=0.0 must be in (0, 1]"),
    ("memory_fraction", 1.5, "memory_fraction=1.5"),
    ("attention_backend", "cuda", "not one of xla, cpu, pallas"),
    ("max_num_seqs", True, "max_num_seqs=True"),
])
def test_engine_config_is_checked_at_construction(field, value, says):
    with pytest.raises(ValueError) as e:
        EngineConfig(**{field: value})
    assert says in str(e.value)


def test_llm_refuses_a_bad_engine_config_before_loading(tmp_path):
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        LLM(tmp_path / "not-even-a-checkpoint", max_num_seqs=0)
    with pytest.raises(TypeError, match="no_such_knob"):
        LLM(tmp_path / "not-even-a-checkpoint", no_such_knob=1)


def test_llm_takes_an_engine_config(hf_tiny):
    config = EngineConfig(num_pages=5, max_num_seqs=3, prefix_caching=False)
    llm = LLM(hf_tiny / "llama", dtype="float32", engine_config=config, page_size=32)
    assert llm.engine.config == dataclasses.replace(config, page_size=32)
    assert llm.engine.capacity == 5 * 32
    assert [s.pool.num_pages for s in llm.engine.schedulers] == [5] and not llm.engine.schedulers[0].pool.prefix_caching


def test_mismatched_prompts_and_params_queue_nothing(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.engine.generate([[1, 5], [1, 6], [1, 7]], [GREEDY, GREEDY])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.engine.generate([[1, 5], [1, 100000]], [GREEDY, GREEDY])
    assert llm.engine.requests == {} and not llm.engine.has_unfinished()


def test_automatic_ids_never_collide_with_a_callers(llm):
    engine = llm.engine
    mine = engine.add_request([1, 5, 6], GREEDY, request_id="req-0")
    auto = [engine.add_request([1, 5, 7], GREEDY) for _ in range(3)]
    assert len({mine.id, *(r.id for r in auto)}) == 4
    with pytest.raises(RequestError, match="'req-0' is already in use"):
        engine.add_request([1, 5], GREEDY, request_id="req-0")
    while engine.has_unfinished():
        engine.step()
    assert all(len(r.output) == 3 for r in (mine, *auto))


def test_a_stalled_engine_raises_instead_of_spinning(llm):
    """Pages held outside the engine leave a queued request nothing to run on: step() says so."""
    engine, pool = llm.engine, llm.engine.schedulers[0].pool
    held = pool.allocate(pool.available)
    try:
        r = engine.add_request([1, 5, 6, 7], GREEDY)
        with pytest.raises(EngineStalled, match="1 waiting, 0 running, 0 of"):
            engine.step()
        assert engine.abort(r.id)
    finally:
        pool.release(held)
    assert engine.generate([[1, 5, 6, 7]], [GREEDY])[0].token_ids == llm.generate([[1, 5, 6, 7]], GREEDY)[0].token_ids


@pytest.mark.parametrize("method", ["score", "add_request", "step"])
def test_a_failure_on_the_loops_thread_reaches_its_caller_and_the_loop_goes_on(llm, monkeypatch, method):
    """Scoring, adding a request and stepping run on the loop's thread: what fails there is raised to the
    caller waiting for it (not left waiting on a dead thread), and the loop serves the next call."""
    prompt = [1, 5, 6, 7]
    call = (lambda: llm.logits([prompt])) if method == "score" else (lambda: llm.generate([prompt], GREEDY))
    want = llm.generate([prompt], GREEDY)[0].token_ids

    def fail(*args, **kwargs):
        raise RuntimeError(f"{method} failed")

    raised = []

    def caller():
        try:
            call()
        except RuntimeError as e:
            raised.append(str(e))

    with monkeypatch.context() as m:
        m.setattr(llm.engine, method, fail)
        waiting = threading.Thread(target=caller, daemon=True)
        waiting.start()
        waiting.join(timeout=120)
    assert not waiting.is_alive(), f"the caller still waits after {method} failed on the loop's thread"
    assert raised == [f"{method} failed"]
    assert llm.generate([prompt], GREEDY)[0].token_ids == want


def test_a_tiny_temperature_is_greedy(llm):
    greedy = llm.generate([[1, 20, 30]], SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    for t in (1e-38, 1e-6):
        out = llm.generate([[1, 20, 30]], SamplingParams(max_tokens=6, temperature=t, seed=1))[0]
        assert out.token_ids == greedy, t


@pytest.mark.parametrize("argv, says", [
    (["--num-processes", "-1"], "number of processes must be at least 1, got -1"),
    (["--num-processes", "2", "--process-id", "2", "--coordinator", "h:1"], "process id 2 is outside 0..1"),
    (["--num-processes", "2"], "need a coordinator address"),
    (["--seed", "-1"], "seed=-1"),
    (["--seed", str(2**32)], f"seed={2**32}"),
    (["--temperature", "-0.5"], "temperature=-0.5"),
    (["--top-p", "0"], "top_p=0"),
    (["--min-p", "2"], "min_p=2"),
    (["--max-tokens", "0"], "max_tokens=0"),
    (["--max-num-seqs", "0"], "max_num_seqs=0"),
    (["--page-size", "24"], "page_size=24"),
])
def test_launcher_checks_flags_before_loading(argv, says, tmp_path, capsys):
    """Exit 2 with one line naming the flag's value: the (missing) model is never opened."""
    code = launch.main([*argv, "--model", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err and "does not exist" not in err


# ---- sharing one engine ------------------------------------------------------------------------------------
PROMPTS = [[1, 5, 9, 13], [1, 40, 41], [1, 7] * 9, [1, 99, 98, 97, 96, 95]]


def test_two_threads_generating_at_once_get_what_each_gets_alone(llm):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    alone = [c.token_ids for c in llm.generate(PROMPTS, params)]
    results: dict[int, list[list[int]]] = {}

    def work(i: int) -> None:
        mine = PROMPTS[i::2]
        results[i] = [c.token_ids for c in llm.generate(mine, params)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == {0: alone[0::2], 1: alone[1::2]}
    assert llm.loop.running == 0 and not llm.engine.has_unfinished()


def test_aborting_from_a_token_callback_stops_that_request_and_nothing_else(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = llm.generate(PROMPTS[:2], params)

    def stop_after_two(r, token, delta):
        if len(r.output) == 2:
            assert engine.abort(r.id)                     # deferred to the end of the step

    a = engine.add_request(PROMPTS[0], params, on_token=stop_after_two)
    b = engine.add_request(PROMPTS[1], params)
    while engine.has_unfinished():
        engine.step()
    assert (a.finish_reason, a.output) == ("abort", expected[0].token_ids[:2])
    assert (b.finish_reason, b.output) == ("length", expected[1].token_ids)
    pool = engine.schedulers[0].pool
    assert pool.available == pool.num_pages


@pytest.mark.parametrize("api", ["engine", "llm"])
def test_leaving_a_stream_early_aborts_its_request(llm, api):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    stream = llm.engine.stream(PROMPTS[2], params) if api == "engine" else iter(llm.stream(PROMPTS[2], params))
    got = [next(stream)[0] for _ in range(2)]
    stream.close()
    assert got == llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0].token_ids
    for _ in range(100):                                 # the loop applies the abort between its steps
        if llm.loop.running == 0:
            break
        time.sleep(0.05)
    with llm.loop.lock:
        pool = llm.engine.schedulers[0].pool
        assert not llm.engine.has_unfinished() and pool.available == pool.num_pages


def test_a_request_the_loop_cannot_serve_is_refused_when_submitted(llm):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.stream([1, 10**6])
    assert llm.loop.running == 0


def test_logprobs_are_the_log_softmax_of_the_logits_the_token_was_drawn_from(llm):
    prompt = PROMPTS[3]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3))[0]
    logits = llm.logits([prompt + greedy.token_ids[:-1]])[0][len(prompt) - 1:]
    ref = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    assert len(greedy.logprobs) == len(greedy.token_ids) == 4
    for t, (token, entry) in enumerate(zip(greedy.token_ids, greedy.logprobs, strict=True)):
        assert set(entry) == {token, *np.argsort(-ref[t])[:3].tolist()}
        np.testing.assert_allclose([entry[i] for i in entry], ref[t, list(entry)], atol=1e-4)
    # sampled: temperature 0.5 and top-k 2, so the token comes from two candidates whose log-probabilities
    # are the log-softmax of the two largest logits / 0.5; the rest are -inf
    drawn = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.5, top_k=2, seed=7, logprobs=3))[0]
    top2 = np.sort(logits[0])[-2:] / 0.5
    entry = drawn.logprobs[0]
    assert len(entry) == 3 and sorted(entry.values())[0] == -np.inf
    np.testing.assert_allclose(sorted(entry.values())[1:], top2 - np.logaddexp.reduce(top2), atol=1e-4)
    assert llm.generate([prompt], SamplingParams(max_tokens=1))[0].logprobs is None


def test_logprobs_beyond_the_limit_are_refused():
    with pytest.raises(ValueError, match=r"logprobs=21 must be None or an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)


def test_an_idle_loop_holds_no_thread_so_an_unused_llm_is_freed(hf_tiny):
    import gc
    import weakref

    llm = LLM(hf_tiny / "llama", dtype="float32")
    llm.generate([[1, 5, 6]], SamplingParams(max_tokens=2))
    for _ in range(100):
        if llm.loop._thread is None:
            break
        time.sleep(0.05)
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert engine() is None                              # its weights and KV pool go with it
