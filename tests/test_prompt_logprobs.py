"""Prompt log-probabilities (SamplingParams.prompt_logprobs; the server's echo with logprobs, vLLM's prompt_logprobs)
against the log-softmax of LLM.logits: lm-evaluation-harness's loglikelihood request on a live server, prompts
split over several steps, a prompt whose prefix the cache holds, a pipeline, and /tokenizer_info against the fixture's
files (the scheduler's bookkeeping alone: tests/test_scheduler.py)."""

import json

import httpx
import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.serve.server import http_server

NAME = "tiny-llama"
TOL = 1e-4
STEP = 64   # max_tokens_per_step: a longer prompt is prefilled in several steps


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm(max_tokens_per_step=STEP)   # the server tests' model (tests/test_openai_server.py)


@pytest.fixture(scope="module")
def url(llm):
    with http_server(llm, NAME) as url:
        yield url


def reference(llm, prompt: list[int]) -> np.ndarray:
    """float32 [T, V]: the log-softmax of one full forward pass's logits; row i predicts token i + 1."""
    logits = llm.logits([prompt])[0]
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def token_texts(llm) -> list[str]:
    """Each vocabulary id's text as the server shows a token (special tokens spelled out)."""
    return [llm.tokenizer.decode([t], skip_special_tokens=False) for t in range(llm.config.vocab_size)]


def random_prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 384, size=n).tolist()


def check_entry(row: np.ndarray, token: int, entry: dict[int, float], k: int) -> None:
    """One prompt position's entry ({id: log-probability}) against the reference's log-softmax `row`: the token's
    own and the k most likely, each within TOL (near-ties may pick either token: that is all TOL leaves open)."""
    assert token in entry and all(abs(v - row[t]) <= TOL for t, v in entry.items())
    kth = np.sort(row)[::-1][k - 1] if k else np.inf
    assert all(row[t] >= kth - TOL for t in entry if t != token)               # among the k most likely
    if row[token] > kth + TOL:
        assert len(entry) == k
    elif row[token] < kth - TOL:
        assert len(entry) == k + 1


def check_rank(row: np.ndarray, token: int, rank: int) -> None:
    """rank: the token's place in the vocabulary (1: the most likely), within the reference's near-ties."""
    assert 1 + (row > row[token] + TOL).sum() <= rank <= (row >= row[token] - TOL).sum()


def check_entries(prompt: list[int], entries: list, ranks: list, ref: np.ndarray, k: int) -> None:
    """Library prompt log-probabilities (Completion.prompt_logprobs and prompt_ranks, first None) against the
    reference."""
    assert len(entries) == len(ranks) == len(prompt) and entries[0] is None and ranks[0] is None
    for i in range(1, len(prompt)):
        check_entry(ref[i - 1], prompt[i], entries[i], k)
        check_rank(ref[i - 1], prompt[i], ranks[i])


# ---- lm-evaluation-harness against the server ---------------------------------------------------------------


def lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness's local-completions parse_logprobs of one choice: the continuation's summed
    log-probability, and whether every continuation token was the most likely."""
    logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(logprobs), all(lp == max(t.values()) for lp, t in zip(logprobs, top, strict=True))


def test_lm_eval_loglikelihood_request_with_batched_token_id_prompts(llm, url):
    context = random_prompt(1, 30)
    greedy = llm.generate([context], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0].token_ids
    prompts = [context + greedy,                       # a greedy continuation: lm-eval's is_greedy holds
               context + random_prompt(2, 5),          # a continuation the model does not expect
               random_prompt(3, 2 * STEP + 20),        # prefilled over three steps
               random_prompt(4, 2)]
    ctxlens = [30, 30, STEP, 1]
    payload = {"model": NAME, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
               "seed": 1234}   # lm-evaluation-harness's loglikelihood payload, tokenized_requests=True
    r = httpx.post(f"{url}/v1/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    texts = token_texts(llm)
    for prompt, ctxlen, choice in zip(prompts, ctxlens, choices, strict=True):
        ref = reference(llm, prompt)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None      # no context: null
        np.testing.assert_allclose(lp["token_logprobs"][1:-1], ref[np.arange(len(prompt) - 1), prompt[1:]],
                                   atol=TOL, rtol=0)
        for i in range(1, len(prompt)):                                         # the most likely token, k = 1
            [(text, value)] = lp["top_logprobs"][i].items()
            assert abs(value - ref[i - 1].max()) <= TOL
            assert any(ref[i - 1, t] >= ref[i - 1].max() - TOL for t, spelt in enumerate(texts) if spelt == text)
        assert abs(lp["token_logprobs"][-1] - ref[-1].max()) <= TOL              # the greedy new token
        assert choice["text"].startswith(llm.tokenizer.decode(prompt))
        total, is_greedy = lm_eval_loglikelihood(choice, ctxlen)
        assert abs(total - ref[np.arange(ctxlen - 1, len(prompt) - 1), prompt[ctxlen:]].sum()) <= TOL * len(prompt)
        assert is_greedy == all(ref[i - 1, prompt[i]] >= ref[i - 1].max() - TOL for i in range(ctxlen, len(prompt)))
    assert lm_eval_loglikelihood(choices[0], 30)[1] and not lm_eval_loglikelihood(choices[1], 30)[1]


def test_echo_with_logprobs_of_a_string_prompt_streamed_or_not(llm, url):
    text = "The quick brown fox"
    prompt = llm.encode(text)
    ref = reference(llm, prompt)
    payload = {"model": NAME, "prompt": text, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0,
               "ignore_eos": True}
    whole = httpx.post(f"{url}/v1/completions", json=payload, timeout=60).json()
    [choice] = whole["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3 and lp["token_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:len(prompt)], ref[np.arange(len(prompt) - 1), prompt[1:]],
                               atol=TOL, rtol=0)
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert choice["text"] == llm.tokenizer.decode(prompt) + llm.generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].text
    assert lp["text_offset"] == np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]).tolist()
    assert whole["usage"]["prompt_tokens"] == len(prompt) and whole["usage"]["completion_tokens"] == 3

    with httpx.stream("POST", f"{url}/v1/completions", json=payload | {"stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in streamed) == choice["text"]
    first = streamed[0]["logprobs"]   # the prompt comes with the first token
    assert first["tokens"] == lp["tokens"][: len(prompt) + 1] and first["token_logprobs"][0] is None
    np.testing.assert_allclose(first["token_logprobs"][1:], lp["token_logprobs"][1: len(prompt) + 1], atol=TOL)


def test_max_tokens_0_with_echo_returns_the_prompt_alone(llm, url):
    prompt = random_prompt(5, 12)
    ref = reference(llm, prompt)
    r = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": prompt, "echo": True, "logprobs": 0,
                                                  "max_tokens": 0}, timeout=60).json()
    [choice] = r["choices"]
    assert choice["text"] == llm.tokenizer.decode(prompt) and len(choice["logprobs"]["tokens"]) == len(prompt)
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:], ref[np.arange(11), prompt[1:]], atol=TOL)
    assert choice["logprobs"]["top_logprobs"][1:] == [{}] * 11                   # logprobs 0: no alternatives
    assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) == (12, 0)
    refused = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_on_completions_and_chat(llm, url):
    prompt = random_prompt(6, 20)
    ref = reference(llm, prompt)
    r = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": prompt, "prompt_logprobs": 2,
                                                  "max_tokens": 2, "n": 2}, timeout=60).json()
    assert len(r["choices"]) == 2
    texts = token_texts(llm)
    for choice in r["choices"]:
        assert choice["logprobs"] is None
        got = choice["prompt_logprobs"]
        assert len(got) == len(prompt) and got[0] is None
        for i in range(1, len(prompt)):
            row, token, position = ref[i - 1], prompt[i], got[i]
            assert list(position)[0] == str(token)                               # the token first, as in vLLM
            check_entry(row, token, {int(t): e["logprob"] for t, e in position.items()}, 2)
            check_rank(row, token, position[str(token)]["rank"])
            by_value = sorted(position.values(), key=lambda e: -e["logprob"])   # the top 2 are ranked 1, 2
            assert [e["rank"] for e in by_value][:2] == [1, 2]
            assert all(e["decoded_token"] == texts[int(t)] for t, e in position.items())
    messages = [{"role": "user", "content": "Name a collective."}]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 1,
                                                          "prompt_logprobs": 0}, timeout=60).json()
    ids = llm.tokenizer.chat_ids(messages)
    ref = reference(llm, ids)
    got = chat["prompt_logprobs"]                                                # on the response, as in vLLM
    assert len(got) == len(ids) == chat["usage"]["prompt_tokens"] and got[0] is None
    assert [list(g) for g in got[1:]] == [[str(t)] for t in ids[1:]]
    np.testing.assert_allclose([g[str(t)]["logprob"] for g, t in zip(got[1:], ids[1:], strict=True)],
                               ref[np.arange(len(ids) - 1), ids[1:]], atol=TOL)


def test_tokenizer_info_is_the_fixture_tokenizer_config_and_chat_template(url, hf_tiny):
    info = httpx.get(f"{url}/tokenizer_info").json()
    config = json.loads((hf_tiny / "llama" / "tokenizer_config.json").read_text())
    template = (hf_tiny / "llama" / "chat_template.jinja").read_text()
    assert info == config | {"chat_template": template}
    assert info["tokenizer_class"] == "TokenizersBackend" and info["eos_token"] == "</s>"


# ---- the library --------------------------------------------------------------------------------------------


def test_prompt_logprobs_over_chunks_and_past_a_cached_prefix(llm, monkeypatch):
    ended = []
    monkeypatch.setattr(llm.loop, "on_end", ended.append)
    long = random_prompt(7, 2 * STEP + 40)                          # three prefill steps
    plain = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([long], plain)                                     # its full pages are now in the prefix cache
    again = llm.generate([long[:-3] + [5, 6]], plain)[0]            # a plain request takes them
    assert again.prompt_logprobs is None and ended[-1].cached_tokens >= 2 * STEP
    asked = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    prompt = long[:-3] + [7, 8, 9]
    [out] = llm.generate([prompt], asked)
    assert ended[-1].cached_tokens == 0                             # computed, not read: its logits are needed
    check_entries(prompt, out.prompt_logprobs, out.prompt_ranks, reference(llm, prompt), 3)
    assert out.token_ids == llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0].token_ids
    batch = [random_prompt(8, 5), [11], prompt]                     # mixed with requests that ask for none
    outs = llm.generate(batch, [SamplingParams(max_tokens=1, prompt_logprobs=0), plain, asked])
    check_entries(batch[0], outs[0].prompt_logprobs, outs[0].prompt_ranks, reference(llm, batch[0]), 0)
    assert outs[1].prompt_logprobs is None and outs[1].prompt_ranks is None
    check_entries(prompt, outs[2].prompt_logprobs, outs[2].prompt_ranks, reference(llm, prompt), 3)


def test_prompt_logprobs_on_a_pipeline_with_tensor_parallel(tiny_llm):
    """pp=2: the chunks of a long prompt are in flight together, and come back in order; tp=2: the vocabulary
    is split, each rank's share reduced on its own."""
    llm = tiny_llm(mesh="pp=2,tp=2", max_tokens_per_step=16)
    prompts = [random_prompt(9, 50), random_prompt(10, 9)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    for prompt, out in zip(prompts, outs, strict=True):
        check_entries(prompt, out.prompt_logprobs, out.prompt_ranks, reference(llm, prompt), 2)


@pytest.mark.parametrize("bad, shown", [(-1, "-1"), (21, "21"), (2.0, "2.0"), (True, "True")])
def test_sampling_params_bound_prompt_logprobs(bad, shown):
    with pytest.raises(ValueError, match=rf"prompt_logprobs={shown} must be None or an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=bad)
