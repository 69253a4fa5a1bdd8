"""The engine loop's contract with its callers: configuration and requests checked before anything is queued,
request ids, a stalled engine reported instead of spinning, and the launcher's flags checked before loading."""

import dataclasses

import pytest

from jaxinfer import LLM, SamplingParams, launch
from jaxinfer.config import EngineConfig
from jaxinfer.engine import EngineStalled, RequestError

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(hf_tiny):
    return LLM(hf_tiny / "llama", dtype="float32", max_tokens_per_step=32)


@pytest.mark.parametrize("field, value, says", [
    ("max_num_seqs", 0, "max_num_seqs=0 must be an integer >= 1"),
    ("max_tokens_per_step", 0, "max_tokens_per_step=0"),
    ("page_size", 12, "page_size=12 must be a power of two"),
    ("page_size", 0, "page_size=0"),
    ("num_pages", 0, "num_pages=0"),
    ("memory_fraction", 0.0, "memory_fraction=0.0 must be in (0, 1]"),
    ("memory_fraction", 1.5, "memory_fraction=1.5"),
    ("attention_backend", "cuda", "not one of xla, pallas"),
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
