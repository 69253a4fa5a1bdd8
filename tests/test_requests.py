"""Request validation (before compilation) and the sampling/stop semantics of LLM.generate, on the tiny Llama."""

import re

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.core import RequestError

PROMPT = "The capital of France is"
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=20)


@pytest.fixture(scope="module")
def llm(tiny_llm) -> LLM:
    return tiny_llm()


@pytest.fixture(scope="module")
def llama_golden(golden):
    return golden("llama")


@pytest.fixture(scope="module")
def greedy(llm):
    """The unconstrained greedy completion of PROMPT (24 tokens), the reference for what follows."""
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    return out


def gen(llm, prompt=PROMPT, **kw):
    return llm.generate(prompt, SamplingParams(**kw))[0]


# ---- requests refused before compilation ------------------------------------------------------------------


def test_config_context_length(llm):
    assert llm.config.context_length == 512


def test_prompt_of_context_length_is_refused(llm):
    before = llm.engine.compilations
    for n in (512, 600):
        with pytest.raises(RequestError) as e:
            llm.generate([5] * n, SamplingParams(max_tokens=4))
        msg = str(e.value)
        assert f"{n} tokens" in msg and "512" in msg and "shorten" in msg
    with pytest.raises(RequestError) as e:                     # scoring needs no room to generate, but no more
        llm.logits([[5] * 513])
    msg = str(e.value)
    assert "513 tokens" in msg and "512" in msg
    assert llm.engine.compilations == before


def test_a_sequence_of_exactly_the_context_length_is_scored(llm):
    ids = [(7 * i) % 380 + 4 for i in range(512)]
    [logits] = llm.logits([ids])
    assert logits.shape == (512, llm.config.vocab_size) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    # causal: the first 40 positions score as they do alone (the long sequence ran in several chunks)
    np.testing.assert_allclose(logits[:40], llm.logits([ids[:40]])[0], atol=1e-5, rtol=0)


def test_sequences_share_scoring_steps_and_score_as_each_alone(llm, llama_golden, monkeypatch):
    """A long sequence and the short prompts are packed into steps of the token budget, chunks and all."""
    long = [(5 * i) % 380 + 4 for i in range(300)]
    sequences = [long, *llama_golden.prompts]
    alone = [llm.logits([ids])[0] for ids in sequences]
    steps, score = [], llm.engine.runner.score
    monkeypatch.setattr(llm.engine.runner, "score", lambda batch: steps.append(batch) or score(batch))
    together = llm.logits(sequences)
    assert len(steps) == -(-sum(map(len, sequences)) // llm.engine.packer.max_tokens)     # every step but the last full
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


def test_empty_prompt_is_refused(llm):
    before = llm.engine.compilations
    with pytest.raises(RequestError, match="empty prompt"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="empty prompt"):
        llm.generate("", SamplingParams(max_tokens=4))      # the fixture tokenizer adds no BOS
    assert llm.engine.compilations == before


@pytest.mark.parametrize("bad", [384, 1000, -1])
def test_token_ids_outside_the_vocabulary(llm, bad):
    before = llm.engine.compilations
    with pytest.raises(RequestError) as e:
        llm.generate([1, 5, bad, 7], SamplingParams(max_tokens=4))
    msg = str(e.value)
    assert f"[{bad}]" in msg and "vocabulary of 384" in msg
    assert llm.engine.compilations == before


def test_one_bad_prompt_refuses_the_batch(llm):
    before = llm.engine.compilations
    with pytest.raises(RequestError, match="vocabulary"):
        llm.generate([[1, 5], [1, 999]], SamplingParams(max_tokens=4))
    assert llm.engine.compilations == before


def test_mismatched_sampling_params(llm):
    before = llm.engine.compilations
    with pytest.raises(ValueError) as e:
        llm.generate([[1, 5], [1, 6], [1, 7]], [SamplingParams(), SamplingParams()])
    assert "2 SamplingParams for 3 prompts" in str(e.value)
    assert llm.engine.compilations == before


def test_still_generates_after_errors(llm, greedy):
    for bad in ([], [5] * 512, [1, 384]):
        with pytest.raises(RequestError):
            llm.generate([bad], SamplingParams(max_tokens=4))
    out = gen(llm, max_tokens=24, temperature=0)
    assert out.token_ids == greedy.token_ids and out.text == greedy.text


# ---- SamplingParams ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, names", [
    (dict(max_tokens=0), ["max_tokens=0", "[1, 2**31)"]),
    (dict(max_tokens=-3), ["max_tokens=-3", "[1, 2**31)"]),
    (dict(temperature=-1), ["temperature=-1", ">= 0"]),
    (dict(top_p=0), ["top_p=0", "(0, 1]"]),
    (dict(top_p=1.5), ["top_p=1.5", "(0, 1]"]),
    (dict(min_p=2), ["min_p=2", "[0, 1]"]),
    (dict(min_p=-0.1), ["min_p=-0.1", "[0, 1]"]),
    (dict(stop=""), ["stop strings", "empty"]),
    (dict(stop=["ok", ""]), ["stop strings", "empty"]),
])
def test_sampling_params_errors(kw, names):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    for n in names:
        assert n in str(e.value)


def test_sampling_params_normalises_stop():
    assert SamplingParams(stop="abc").stop == ["abc"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []


# ---- stopping -----------------------------------------------------------------------------------------------


def test_greedy_matches_the_golden_tokens(llm, llama_golden):
    ids, want = llama_golden.prompts, llama_golden.greedy
    short = [i for i, p in enumerate(ids) if len(p) <= 16]       # one prefill bucket
    outs = llm.generate([ids[i] for i in short[:1]], SamplingParams(max_tokens=24, temperature=0))
    assert outs[0].token_ids == want[short[0]]


def test_max_tokens_gives_length(llm, greedy):
    out = gen(llm, max_tokens=5, temperature=0)
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == greedy.token_ids[:5]
    assert out.prompt_token_ids == greedy.prompt_token_ids


def test_stop_token_ids(llm, greedy):
    ref = greedy.token_ids
    stop = ref[3]
    expected = ref[: ref.index(stop) + 1]
    out = gen(llm, max_tokens=24, temperature=0, stop_token_ids=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop   # vLLM's stop_reason: the id that matched
    assert out.token_ids == expected and out.token_ids[-1] == stop


def test_stop_token_beyond_max_tokens_is_not_reached(llm, greedy):
    ref = greedy.token_ids
    unseen = next(t for t in range(4, 384) if t not in ref)
    out = gen(llm, max_tokens=6, temperature=0, stop_token_ids=[unseen])
    assert out.finish_reason == "length" and out.token_ids == ref[:6]


def pick_stop_string(text: str) -> tuple[str, int]:
    """Three letters that first occur in the text at index >= 3 (something comes before them)."""
    for m in re.finditer(r"(?=([A-Za-z]{3}))", text):
        s = m.group(1)
        if text.find(s) >= 3:
            return s, text.find(s)
    raise AssertionError(f"no three-letter stop string in {text!r}")


def test_stop_string_truncates_text(llm, greedy):
    stop, at = pick_stop_string(greedy.text)
    out = gen(llm, max_tokens=24, temperature=0, stop=["zzzzqqq", stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == greedy.text[:at]
    assert stop not in out.text
    n = len(out.token_ids)
    assert 0 < n < len(greedy.token_ids) and out.token_ids == greedy.token_ids[:n]


def test_stop_string_included_on_request(llm, greedy):
    stop, at = pick_stop_string(greedy.text)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, stop=stop,
                                              include_stop_str_in_output=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == greedy.text[: at + len(stop)]


def test_unmatched_stop_string_changes_nothing(llm, greedy):
    out = gen(llm, max_tokens=24, temperature=0, stop=["zzzzqqq"])
    assert out.finish_reason == "length"
    assert out.text == greedy.text and out.token_ids == greedy.token_ids


# ---- sampling ------------------------------------------------------------------------------------------


def test_same_seed_same_output(llm):
    a = gen(llm, max_tokens=16, seed=7, **SAMPLED)
    b = gen(llm, max_tokens=16, seed=7, **SAMPLED)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert len(a.token_ids) == 16


def test_different_seeds_differ(llm):
    first = gen(llm, max_tokens=16, seed=0, **SAMPLED).token_ids
    others = [gen(llm, max_tokens=16, seed=s, **SAMPLED).token_ids for s in (1, 2, 3)]
    assert any(o != first for o in others)


def test_sampling_is_not_greedy(llm, greedy):
    outs = [gen(llm, max_tokens=16, seed=s, temperature=1.0).token_ids for s in (0, 1)]
    assert any(o != greedy.token_ids[:16] for o in outs)


def test_top_k_1_is_greedy(llm, greedy):
    for seed in (0, 1):
        out = gen(llm, max_tokens=24, temperature=0.8, top_k=1, seed=seed)
        assert out.token_ids == greedy.token_ids


def test_min_p_1_is_greedy(llm, greedy):
    out = gen(llm, max_tokens=24, temperature=1.0, min_p=1.0, seed=3)
    assert out.token_ids == greedy.token_ids


def test_tiny_top_p_is_greedy(llm, greedy):
    out = gen(llm, max_tokens=24, temperature=1.0, top_p=1e-6, seed=4)
    assert out.token_ids == greedy.token_ids


def test_a_seeded_request_does_not_depend_on_its_batch(llm, greedy, llama_golden):
    alone = gen(llm, max_tokens=12, seed=11, **SAMPLED).token_ids
    other = llama_golden.prompts[0]
    both = llm.generate([PROMPT, other], [SamplingParams(max_tokens=12, seed=11, **SAMPLED),
                                          SamplingParams(max_tokens=12, temperature=0)])
    assert both[0].token_ids == alone
    assert both[1].token_ids == llama_golden.greedy[0][:12]


def test_budget_is_capped_by_the_context(llm):
    out = llm.generate([5] * 511, SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_a_prompt_of_non_integers_is_refused(llm):
    with pytest.raises(TypeError, match="integer token ids"):
        llm.generate([1.5, 2])
