"""A seeded fuzz run against a live server (jaxinfer.serve.fuzz): a few hundred malformed and extreme requests
beside a healthy stream. Every answer is a 200 or a 4xx with an OpenAI error body, the healthy stream gets its
tokens alone, and afterwards the pool is whole and /metrics agrees with the engine. (A larger run:
`python -m jaxinfer.serve.fuzz --requests 5000`.)"""

import asyncio

import pytest

from jaxinfer import SamplingParams
from jaxinfer.serve.fuzz import fuzz, main, malformed, metric
from jaxinfer.serve.server import http_server

NAME = "tiny-llama"
HEALTHY = ([1, 250, 96, 173, 17, 299], 40)


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm(max_tokens_per_step=64)


def test_the_generator_is_seeded_and_varied():
    a = [p.content() for p in malformed(3, 200, NAME, 512, 1000)]
    assert a == [p.content() for p in malformed(3, 200, NAME, 512, 1000)]
    assert a != [p.content() for p in malformed(4, 200, NAME, 512, 1000)]
    assert len(set(a)) > 150


def test_a_fuzz_run_leaves_the_server_serving(llm):
    prompt, max_tokens = HEALTHY
    alone = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0].text
    probes = list(malformed(0, 300, NAME, llm.config.vocab_size, 4 << 20))
    with http_server(llm, NAME) as url:
        before = metric(url, "jaxinfer:request_success_total")
        outcome, texts = asyncio.run(fuzz(url, NAME, probes, HEALTHY))
        ended = metric(url, "jaxinfer:request_success_total") - before
        running = metric(url, "jaxinfer:num_requests_running")
        pages = metric(url, "jaxinfer:kv_cache_pages_in_use")
    assert outcome.violations == []
    assert sum(outcome.statuses.values()) == len(probes)
    assert outcome.statuses[200] > 20 and sum(n for s, n in outcome.statuses.items() if 400 <= s < 500) > 150
    assert "".join(texts) == alone
    assert ended == outcome.engine_requests and running == 0 and pages == 0
    engine = llm.engine
    assert not engine.requests and llm.loop.running == 0 and llm.loop.dead is None
    assert all(s.pool.available == s.pool.num_pages for s in engine.schedulers)


def test_bad_arguments_are_refused():
    assert main(["--requests", "0"]) == 2
