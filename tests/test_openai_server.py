"""The OpenAI-compatible server, driven by the official `openai` client against a live server on 127.0.0.1:
outputs equal LLM.generate's, logprobs equal the log-softmax of LLM.logits, concurrent streams equal each
alone, a client that leaves has its request aborted, /metrics adds up, bad requests get OpenAI error bodies
(and the server goes on), a request failing in the engine gets a 500 alone, a dead engine makes /health 503,
batch files give one line per request, and SIGTERM drains, aborts what outlasts the grace period, and exits 0."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from conftest import devices_of_its_own
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.scheduler import Request
from jaxinfer.serve.batch_job import run_batch_file
from jaxinfer.serve.openai_api import OpenAIServing
from jaxinfer.serve.server import MAX_REQUEST_BYTES, build_app

KEY, NAME = "sk-test", "tiny-llama"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The quick brown fox", "Ring", "Distributed inference splits a model", "All-reduce and all-gather"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm(max_tokens_per_step=64)


def live(llm):
    """A live server of `llm` on a free port, in a thread: its URL; stopped when the generator is closed."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(llm, NAME, api_key=KEY), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def url(llm):
    """A live server for the module, stopped after it."""
    yield from live(llm)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def all_pages_back(llm, timeout: float = 30.0) -> bool:
    """Waits for the loop to apply aborts (between steps); then every page of the pool is available."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with llm.loop.lock:
            pool = llm.engine.schedulers[0].pool
            if llm.loop.running == 0 and not llm.engine.requests and pool.available == pool.num_pages:
                return True
        time.sleep(0.05)
    return False


def test_completions_equal_generate_streaming_or_not(llm, client):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [c.text for c in llm.generate(PROMPTS, params)]
    r = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == expected
    assert {c.finish_reason for c in r.choices} == {"length"}
    prompt_tokens = sum(len(llm.encode(p)) for p in PROMPTS)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 6 * len(PROMPTS))

    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_equals_llm_chat_streaming_or_not(llm, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a collective."}]
    expected = llm.chat(messages, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    r = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_are_the_log_softmax_of_the_logits(llm, client):
    prompt = llm.encode(PROMPTS[2])
    greedy = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    logits = llm.logits([prompt + greedy[:-1]])[0][len(prompt) - 1:]
    ref = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=5,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(4), greedy], atol=1e-4)
    for t in range(4):   # five entries, though two of each position's top five read "\ufffd" (one is token_id:N)
        assert len(lp.top_logprobs[t]) == 5
        np.testing.assert_allclose(list(lp.top_logprobs[t].values()), np.sort(ref[t])[::-1][:5], atol=1e-4)
    as_ids = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=5,
                                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert as_ids.choices[0].logprobs.tokens == [f"token_id:{t}" for t in greedy]
    for t in range(4):
        assert {int(k.removeprefix("token_id:")) for k in as_ids.choices[0].logprobs.top_logprobs[t]} == set(
            np.argsort(-ref[t])[:5].tolist())
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy: the token is the most likely


def test_n_choices_with_a_seed_are_reproducible(client):
    ask = dict(model=NAME, prompt=PROMPTS[1], max_tokens=5, temperature=1.0, n=3, seed=11)
    a, b = client.completions.create(**ask), client.completions.create(**ask)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1   # choice i is drawn with seed + i


def test_32_concurrent_streams_equal_each_alone(llm, url):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 384, size=int(n)).tolist() for n in rng.integers(1, 40, size=32)]
    lengths = rng.integers(1, 9, size=32).tolist()
    alone = [llm.generate([p], SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))[0].text
             for p, m in zip(prompts, lengths, strict=True)]

    async def one(c: openai.AsyncOpenAI, prompt: list[int], m: int) -> tuple[str, str]:
        stream = await c.completions.create(model=NAME, prompt=prompt, max_tokens=m, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as c:
            return await asyncio.gather(*(one(c, p, m) for p, m in zip(prompts, lengths, strict=True)))

    got = asyncio.run(run())
    assert [t for t, _ in got] == alone and {f for _, f in got} == {"length"}
    assert all_pages_back(llm)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_has_its_request_aborted(llm, url, stream):
    n = 1 if stream else 8   # 8 choices of 500 tokens: far from done when the client gives up
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": stream, "n": n}
    headers = {"Authorization": f"Bearer {KEY}"}
    aborted = ("jaxinfer:request_success_total", (("finished_reason", "abort"), ("model_name", NAME)))
    before = metric_values(url).get(aborted, 0)
    with httpx.Client(timeout=60) as http:
        if stream:
            with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
                assert next(line for line in r.iter_lines() if line.startswith("data: {"))
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{url}/v1/completions", json=body, headers=headers, timeout=0.5)
    assert all_pages_back(llm)
    assert metric_values(url)[aborted] - before == n


def metric_values(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_add_up_to_the_requests_sent(llm, client, url):
    assert all_pages_back(llm)
    before = metric_values(url)
    lengths = [3, 5, 2]
    for i, m in enumerate(lengths):
        client.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=m, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metric_values(url)
    name = (("model_name", NAME),)

    def delta(metric: str, labels=name) -> float:
        return after.get((metric, labels), 0.0) - before.get((metric, labels), 0.0)

    assert delta("jaxinfer:request_success_total", (("finished_reason", "length"), ("model_name", NAME))) == 3
    assert delta("jaxinfer:generation_tokens_total") == sum(lengths)
    assert delta("jaxinfer:prompt_tokens_total") == sum(len(llm.encode(p)) for p in PROMPTS[:3])
    assert delta("jaxinfer:time_to_first_token_seconds_count") == 3
    assert delta("jaxinfer:e2e_request_latency_seconds_count") == 3
    assert delta("jaxinfer:inter_token_latency_seconds_count") == sum(m - 1 for m in lengths)
    assert after[("jaxinfer:num_requests_running", name)] == 0
    assert after[("jaxinfer:kv_cache_pages_in_use", name)] == 0
    assert after[("jaxinfer:kv_cache_pages", name)] == llm.engine.pages_per_replica
    assert delta("jaxinfer:prefix_cache_queries_total") >= delta("jaxinfer:prefix_cache_hits_total") >= 0


@pytest.mark.parametrize("body, param, says", [
    ({"max_tokens": -1}, "max_tokens", "max_tokens=-1"),
    ({"temperature": -1}, "temperature", "temperature=-1"),
    ({"top_p": 0}, "top_p", "top_p=0"),
    ({"prompt": list(range(1, 300)) * 2}, "prompt", "context limit of 512"),
    ({"max_tokens": 600}, "max_tokens", "maximum context length is 512"),
    ({"n": 0}, "n", "n=0"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"temperature": "hot"}, "temperature", "temperature"),
])
def test_bad_requests_get_400_with_an_openai_error_and_the_server_goes_on(client, body, param, says):
    ask = {"model": NAME, "prompt": "Hello", "max_tokens": 2} | body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{k: v for k, v in ask.items() if k in ("model", "prompt")},
                                  extra_body={k: v for k, v in ask.items() if k not in ("model", "prompt")})
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == param
    assert says in e.value.body["message"]
    assert client.completions.create(model=NAME, prompt="Hello", max_tokens=2).choices[0].finish_reason


def test_malformed_json_and_a_wrong_key(client, url):
    r = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": ', headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert [m.id for m in client.models.list().data] == [NAME]
    hi = [{"role": "user", "content": "Hi"}]
    for extra, param in [({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=hi, max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == param and "not supported" in e.value.body["message"]


BIG = 2**70


@pytest.mark.parametrize("path, body, param, says", [
    # every integer that reaches the engine, bounded with the field, the value and the limit in the message
    ("c", {"n": 65}, "n", "n=65 must be an integer in [1, 64]"),
    ("c", {"n": BIG}, "n", f"n={BIG}"),
    ("c", {"best_of": 3}, "best_of", "best_of=3"),
    ("c", {"logprobs": 21}, "logprobs", "logprobs=21 must be None or an integer in [0, 20]"),
    ("c", {"logprobs": -1}, "logprobs", "logprobs=-1"),
    ("c", {"max_tokens": BIG}, "max_tokens", f"max_tokens={BIG} must be an integer in [1, 2**31)"),
    ("c", {"seed": -1}, "seed", "seed=-1 must be None or an integer in [0, 2**32)"),
    ("c", {"seed": 2**64}, "seed", f"seed={2**64}"),
    ("c", {"top_k": -2}, "top_k", "top_k=-2 must be an integer in [-1, 2**31)"),
    ("c", {"top_k": BIG}, "top_k", f"top_k={BIG}"),
    ("c", {"stop_token_ids": [5, BIG]}, "stop_token_ids", "must be integers in [0, 2**31)"),
    ("c", {"stop_token_ids": [-1]}, "stop_token_ids", "[-1]"),
    ("c", {"prompt": [5, BIG]}, "prompt", f"prompt token ids [{BIG}] must be integers in [0, 384)"),
    ("c", {"prompt": [5, -1]}, "prompt", "[-1] must be integers in [0, 384)"),
    ("c", {"prompt": [5, 384]}, "prompt", "[384] must be integers in [0, 384)"),
    ("c", {"prompt": [5, True]}, "prompt", "[True] must be integers"),
    ("c", {"prompt": [[5, 6], [7, 2**40]]}, "prompt", f"[{2**40}] must be integers"),
    ("c", {"prompt": [[5, 6], 7]}, "prompt", "a list of lists of token ids"),
    ("c", {"prompt": "\ud800"}, "prompt", "lone surrogates"),
    ("chat", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "lone surrogates"),
    ("c", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "truncate_prompt_tokens=0 must be -1 (the context limit) or an integer in [1, 512]"),
    ("c", {"truncate_prompt_tokens": 513}, "truncate_prompt_tokens", "truncate_prompt_tokens=513"),
    ("c", {"truncate_prompt_tokens": -BIG}, "truncate_prompt_tokens", f"truncate_prompt_tokens={-BIG}"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs", "top_logprobs=21 must be an integer in [0, 20]"),
    ("chat", {"top_logprobs": -1, "logprobs": True}, "top_logprobs", "top_logprobs=-1"),
    ("c", {"echo": True, "logprobs": 21}, "logprobs", "logprobs=21 must be None or an integer in [0, 20]"),
    ("c", {"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs=21 must be an integer in [0, 20]"),
    ("c", {"prompt_logprobs": -1}, "prompt_logprobs", "(-1, the whole vocabulary, is not supported)"),
    ("c", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available with stream=true"),
    ("chat", {"prompt_logprobs": -2}, "prompt_logprobs", "prompt_logprobs=-2 must be an integer in [0, 20]"),
    ("c", {"max_tokens": 0}, "max_tokens", "max_tokens=0 needs echo=true"),
    ("c", {"max_tokens": -1, "echo": True}, "max_tokens", "max_tokens=-1 must be an integer in [1, 2**31)"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens=0 must be an integer"),
    ("chat", {"max_completion_tokens": BIG}, "max_completion_tokens", f"max_completion_tokens={BIG}"),
    ("chat", {"max_completion_tokens": 600}, "max_completion_tokens", "maximum context length is 512"),
    ("chat", {"n": 0}, "n", "n=0"),
    # JSON types are not coerced, and floats must be finite (Python's json reads NaN and Infinity)
    ("c", {"n": True}, "n", "valid integer"),
    ("c", {"max_tokens": 3.0}, "max_tokens", "valid integer"),
    ("c", {"max_tokens": "3"}, "max_tokens", "valid integer"),
    ("c", {"temperature": float("nan")}, "temperature", "finite number"),
    ("c", {"top_p": float("inf")}, "top_p", "finite number"),
    ("chat", {"min_p": -float("inf")}, "min_p", "finite number"),
    # fields this server does not implement are refused, naming them; so is a typo
    ("c", {"max_token": 5}, "max_token", "`max_token` is not supported"),
    ("c", {"min_tokens": 2}, "min_tokens", "`min_tokens` is not supported"),
    ("c", {"guided_json": {"type": "object"}}, "guided_json", "`guided_json` is not supported"),
    ("c", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex", "`guided_regex`, `guided_choice` are"),
    ("c", {"response_format": {"type": "json_object"}}, "response_format", "`response_format` is not supported"),
    ("chat", {"guided_grammar": "root ::= x"}, "guided_grammar", "`guided_grammar` is not supported"),
    ("chat", {"functions": [{"name": "f"}]}, "functions", "`functions` is not supported"),
    ("chat", {"function_call": "auto"}, "function_call", "`function_call` is not supported"),
    ("chat", {"tool_choice": "auto"}, "tool_choice", "tool_choice other than \"none\" is not supported"),
    ("chat", {"logit_bias": {"5": 1.0}}, "logit_bias", "logit_bias is not supported"),
    ("c", {"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream=true"),
    ("chat", {"stream_options": {"include_usage": True}, "stream": False}, "stream_options", "stream=true"),
])
def test_every_field_is_bounded_where_it_is_made(url, path, body, param, says):
    """A 400 naming the field, the value and the limit, never a 500 (ints past int64 and NaN included)."""
    if path == "c":
        route, ask = "/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 2}
    else:
        route, ask = "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 2}
    raw = json.dumps(ask | body)    # allow_nan: NaN and Infinity as Python's json writes them
    r = httpx.post(f"{url}{route}", content=raw, headers=AUTH | {"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert says in error["message"]


def test_fields_that_change_nothing_are_accepted_and_null_is_absent(llm, client):
    expected = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0].text
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=2, temperature=0, user="u1", extra_body={
        "ignore_eos": True, "metadata": {"k": "v"}, "service_tier": "auto", "guided_json": None, "min_tokens": None})
    assert r.choices[0].text == expected
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          tool_choice="none", store=False, parallel_tool_calls=False)
    assert chat.choices[0].finish_reason


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, client):
    prompt = llm.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for keep, kept in [(5, prompt[-5:]), (-1, prompt), (len(prompt) + 3, prompt)]:
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True, "truncate_prompt_tokens": keep})
        assert r.choices[0].text == llm.generate([kept], params)[0].text
        assert r.usage.prompt_tokens == len(kept)


def test_an_unknown_model_is_404_model_not_found(client, url):
    odd = httpx.post(f"{url}/v1/completions", content=b'{"model": "\\ud800", "prompt": "a"}',
                     headers=AUTH | {"Content-Type": "application/json"})   # a lone surrogate, echoed escaped
    assert odd.status_code == 404 and "`\ud800` does not exist" in odd.json()["error"]["message"]
    for call in (lambda: client.completions.create(model="gpt-7", prompt="Hello", max_tokens=2),
                 lambda: client.chat.completions.create(model="gpt-7", messages=[{"role": "user", "content": "Hi"}])):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.status_code == 404 and "`gpt-7` does not exist" in e.value.body["message"]
        assert (e.value.body["type"], e.value.body["code"], e.value.body["param"]) == (
            "not_found_error", "model_not_found", "model")


def test_stop_reason_is_the_stop_string_or_token_id_that_matched(llm, client):
    free = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    token = next(t for i, t in enumerate(free.token_ids) if i >= 2 and t not in free.token_ids[:i])
    word = next(free.text[i:i + 2] for i in range(2, len(free.text) - 1) if free.text[i:i + 2] not in free.text[:i + 1])
    for extra, reason in [({"stop_token_ids": [token]}, token), ({"stop": [word]}, word)]:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **extra)
        expected = llm.generate([PROMPTS[2]], params)[0]
        assert expected.finish_reason == "stop" and expected.stop_reason == reason
        ask = dict(model=NAME, prompt=PROMPTS[2], max_tokens=6, temperature=0, extra_body={"ignore_eos": True} | extra)
        r = client.completions.create(**ask)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (expected.text, "stop")
        assert r.model_dump()["choices"][0]["stop_reason"] == reason
        last = [c for c in client.completions.create(**ask, stream=True)][-1].model_dump()["choices"][0]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", reason)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.model_dump()["choices"][0]["stop_reason"] is None   # a length finish has none


def same_text_tokens(llm) -> tuple[int, int]:
    """Two token ids that decode to the same text (the byte-level vocabulary's fragments all read "\ufffd")."""
    seen: dict[str, int] = {}
    for t in range(llm.config.vocab_size):
        text = llm.tokenizer.decode([t], skip_special_tokens=False)
        if text in seen:
            return seen[text], t
        seen[text] = t
    raise AssertionError("no two tokens of the vocabulary decode to the same text")


def test_top_logprobs_keep_tokens_whose_texts_coincide(llm):
    a, b = same_text_tokens(llm)
    serving = OpenAIServing(llm, NAME)
    text = serving._token_text(a)
    other = next(t for t in range(llm.config.vocab_size) if serving._token_text(t) not in (text, ""))
    entry = {b: -2.0, a: -0.5, other: -1.0, 7: -float("inf")}
    got = serving._completion_logprobs([a], [entry], 4)["top_logprobs"][0]
    assert list(got.items()) == [(text, -0.5), (serving._token_text(other), -1.0), (f"token_id:{b}", -2.0),
                                 (serving._token_text(7), -9999.0)]
    as_ids = serving._completion_logprobs([a], [entry], 4, as_ids=True)
    assert as_ids["tokens"] == [f"token_id:{a}"]
    assert list(as_ids["top_logprobs"][0]) == [f"token_id:{t}" for t in (a, other, b, 7)]


def test_unknown_routes_wrong_methods_and_big_bodies_get_openai_errors(url):
    def error(r: httpx.Response, status: int) -> dict:
        assert r.status_code == status, r.text
        return r.json()["error"]

    assert "no route POST /v1/embeddings" in error(httpx.post(f"{url}/v1/embeddings", json={}, headers=AUTH),
                                                   404)["message"]
    assert error(httpx.get(f"{url}/nothing/here"), 404)["type"] == "not_found_error"
    wrong = httpx.get(f"{url}/v1/completions", headers=AUTH)
    assert "GET is not allowed" in error(wrong, 405)["message"] and wrong.headers["allow"] == "POST"
    # over the limit: refused before parsing, from Content-Length or while a chunked body is read
    big = b'{"model": "tiny-llama", "prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}'
    headers = AUTH | {"Content-Type": "application/json"}
    assert "larger than this server's limit" in error(httpx.post(f"{url}/v1/completions", content=big,
                                                                 headers=headers), 413)["message"]
    chunked = httpx.post(f"{url}/v1/completions", content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                         headers=headers)
    assert "transfer-encoding" in chunked.request.headers
    assert error(chunked, 413)["type"] == "invalid_request_error"
    small = iter([b'{"model": "tiny-llama", ', b'"prompt": "Hello", "max_tokens": 2}'])
    assert httpx.post(f"{url}/v1/completions", content=small, headers=headers).status_code == 200


def test_the_bearer_scheme_in_any_case(url):
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 2}
    for header, status in [(f"bearer {KEY}", 200), (f"BEARER {KEY}", 200), (f"Bearer  {KEY}", 200),
                           (f"Basic {KEY}", 401), (f"Bearer {KEY}x", 401), (KEY, 401), ("Bearer", 401)]:
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": header})
        assert r.status_code == status, header
        if status == 401:
            assert r.json()["error"]["code"] == "invalid_api_key"


MARK = 4_000_000_007    # the seed of the request the engine fails (greedy: the seed changes nothing else)


def test_a_request_failing_in_the_engine_gets_a_500_alone(llm, url, monkeypatch):
    """Its tokens fail to be handed out: a non-streamed request gets a 500 OpenAI error, a streamed one an error
    event then [DONE]; a request beside it gets its tokens, and the server goes on."""
    real = Request.add_token

    def add_token(self, token, logprobs=None):
        if self.params.seed == MARK and len(self.output) >= 2:
            raise RuntimeError("injected fault")
        return real(self, token, logprobs)
    monkeypatch.setattr(Request, "add_token", add_token)
    healthy = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    faulty = healthy | {"prompt": PROMPTS[1], "seed": MARK}
    expected = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].text

    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as c:
            async def stream() -> list[str]:
                async with c.stream("POST", "/v1/completions", json=faulty | {"stream": True}) as r:
                    return [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return await asyncio.gather(c.post("/v1/completions", json=faulty), stream(),
                                        c.post("/v1/completions", json=healthy))

    failed, events, ok = asyncio.run(run())
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "internal_server_error" and "injected fault" in failed.json()[
        "error"]["message"]
    assert events[-1] == "data: [DONE]" and "injected fault" in json.loads(events[-2][6:])["error"]["message"]
    assert sum(json.loads(e[6:])["choices"][0]["finish_reason"] is None for e in events[:-2]) == 2  # its 2 tokens
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected
    assert all_pages_back(llm)
    monkeypatch.undo()
    assert httpx.post(f"{url}/v1/completions", json=faulty, headers=AUTH).json()["choices"][0]["finish_reason"]


def test_a_dead_engine_makes_health_503_and_refuses_requests(url, llm, monkeypatch):
    name = (("model_name", NAME),)
    assert metric_values(url)[("jaxinfer:engine_healthy", name)] == 1
    monkeypatch.setattr(llm.loop, "dead", RuntimeError("device lost"))
    r = httpx.get(f"{url}/health")
    assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
    assert metric_values(url)[("jaxinfer:engine_healthy", name)] == 0
    refused = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "Hello", "max_tokens": 2},
                         headers=AUTH)
    assert refused.status_code == 503 and "device lost" in refused.json()["error"]["message"]
    assert refused.json()["error"]["type"] == "service_unavailable_error"
    monkeypatch.undo()
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.fixture(scope="module")
def small(hf_tiny):
    """An engine whose page pool (4 pages of 16: 64 tokens) is smaller than the context (512), live."""
    llm = LLM(hf_tiny / "llama", dtype="float32", max_tokens_per_step=64, num_pages=4)
    for url in live(llm):
        yield llm, url


def test_a_request_that_cannot_fit_the_pool_is_400_and_chat_defaults_to_the_room_left(small):
    llm, url = small
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=list(range(1, 41)), max_tokens=100)
    assert e.value.body["param"] == "max_tokens" and "page pool's 64 tokens" in e.value.body["message"]
    messages = [{"role": "user", "content": "word " * 10}]
    assert len(llm.tokenizer.chat_ids(messages)) == 56
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=100)
    assert e.value.body["param"] == "max_completion_tokens"
    expected = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
    r = client.chat.completions.create(model=NAME, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (expected, "length")
    assert r.usage.completion_tokens == 8   # no max_tokens: the 64 - 56 tokens the pool has room for


def test_models_health_version_tokenize_detokenize(llm, url):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]
    ids = httpx.post(f"{url}/tokenize", json={"prompt": PROMPTS[0]}, headers=auth).json()
    assert ids["tokens"] == llm.encode(PROMPTS[0]) and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == 512
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=auth).json()
    assert chat["tokens"] == llm.tokenizer.chat_ids([{"role": "user", "content": "Hi"}])
    text = httpx.post(f"{url}/detokenize", json={"tokens": ids["tokens"]}, headers=auth).json()["prompt"]
    assert text == llm.tokenizer.decode(ids["tokens"])
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**6]}, headers=auth)
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    assert httpx.get(f"{url}/tokenizer_info").status_code == 401          # guarded like /tokenize
    info = httpx.get(f"{url}/tokenizer_info", headers=auth).json()         # what lm-eval's remote tokenizer reads
    assert info["eos_token"] == "</s>" and info["chat_template"] == llm.tokenizer.chat_template


def test_a_batch_file_gives_one_result_line_per_request(llm, tmp_path):
    good = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": good},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": good | {"max_tokens": -5}},
        "{not json",
        {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": good},
        {"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": chat},
    ]
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n\n")
    counts = run_batch_file(llm, NAME, src, out)
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert counts == {"requests": 5, "succeeded": 2, "failed": 3} and len(results) == 5
    assert [r["custom_id"] for r in results] == ["a", "b", None, "c", "d"]
    expected = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].text
    assert results[0]["response"]["status_code"] == 200
    assert results[0]["response"]["body"]["choices"][0]["text"] == expected
    assert results[1]["response"]["status_code"] == 400 and "max_tokens=-5" in results[1]["response"]["body"][
        "error"]["message"]
    assert results[2]["response"] is None and results[2]["error"]["code"] == "invalid_json"
    assert results[3]["response"] is None and "/v1/embeddings" in results[3]["error"]["message"]
    assert results[4]["response"]["body"]["object"] == "chat.completion"


def test_sigterm_aborts_what_outlasts_the_grace_period_then_exits_0(tmp_path, subprocess_env):
    """The CLI on the embedded default with --grace-period 1: a streamed and a non-streamed request still running
    when the grace period is over end normally with finish_reason "abort" (the stream's last chunk then [DONE];
    a 200 body with the tokens so far); the server then stops listening and the process exits 0, with no
    traceback in its log."""
    port = free_port()
    env = devices_of_its_own(subprocess_env)
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.serve", "--port", str(port), "--grace-period", "1",
                             "--no-warmup"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "timeout"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        whole: list[httpx.Response] = []
        other = threading.Thread(target=lambda: whole.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                         timeout=120)))
        other.start()
        chunks, lines, running_both = [], [], None
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if running_both is None and metric_values(url)[
                            ("jaxinfer:num_requests_running", (("model_name", model),))] == 2:
                        running_both = len(chunks)      # both decode now: a few more steps, then SIGTERM
                    if running_both is not None and len(chunks) == running_both + 5:
                        proc.send_signal(signal.SIGTERM)
        other.join(timeout=60)
        assert running_both is not None
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort" and lines[-1] == "data: [DONE]"
        assert len(chunks) - 1 == sum(c["choices"][0]["finish_reason"] is None for c in chunks) < 1000
        assert whole[0].status_code == 200
        done = whole[0].json()
        assert done["choices"][0]["finish_reason"] == "abort" and done["choices"][0]["text"]
        assert 0 < done["usage"]["completion_tokens"] < 1000
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read()
        assert "Traceback" not in log and "grace period over: aborting 2 request(s)" in log
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
