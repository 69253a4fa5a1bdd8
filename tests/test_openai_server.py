"""The OpenAI-compatible server, driven by the official `openai` client against a live server on 127.0.0.1:
outputs equal LLM.generate's, logprobs equal the log-softmax of LLM.logits, concurrent streams equal each
alone, a client that leaves has its request aborted, /metrics adds up, bad requests get OpenAI error bodies
(and the server goes on), batch files give one line per request, and SIGTERM drains and exits 0."""

import asyncio
import json
import os
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
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer import LLM, SamplingParams
from jaxinfer.batch_job import run_batch_file
from jaxinfer.serve import build_app

KEY, NAME = "sk-test", "tiny-llama"
PROMPTS = ["The quick brown fox", "Ring", "Distributed inference splits a model", "All-reduce and all-gather"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llm(hf_tiny):
    return LLM(hf_tiny / "llama", dtype="float32", max_tokens_per_step=64)


@pytest.fixture(scope="module")
def url(llm):
    """A live server for the module, stopped after it."""
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
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(4), greedy], atol=1e-4)
    for t in range(4):
        assert len(lp.top_logprobs[t]) <= 3   # token strings may coincide; their values are the top three
        np.testing.assert_allclose(sorted(lp.top_logprobs[t].values(), reverse=True),
                                   np.sort(ref[t])[::-1][:len(lp.top_logprobs[t])], atol=1e-4)
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
    ({"model": "gpt-7"}, "model", "`gpt-7` does not exist"),
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


def test_sigterm_finishes_the_request_in_flight_then_exits_0(tmp_path):
    """The CLI on the embedded default: a streaming request in flight when SIGTERM arrives still completes;
    the server then stops listening and the process exits 0."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAXINFER_CACHE": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.serve", "--port", str(port), "--grace-period", "60",
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
        body = {"model": model, "prompt": "Hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stream": True}
        chunks = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 1:
                        proc.send_signal(signal.SIGTERM)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["finish_reason"] is None) == 24
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
