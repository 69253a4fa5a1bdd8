"""bench_startup on a tiny random model: what each process compiles, cold and warm, and the figures' order."""

import argparse

from jaxinfer.bench import startup as bench_startup
from jaxinfer.random_model import DEFAULT

TINY = {**DEFAULT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_cold_compiles_warm_reads_back(monkeypatch, random_checkpoint):
    path = random_checkpoint(TINY)
    monkeypatch.setattr(bench_startup, "checkpoint", lambda preset: str(path))
    r = bench_startup.run(argparse.Namespace(preset=["small"]))["small"]
    cold, warm = r["cold"], r["warm"]
    # the server's process compiles every bucket before its first request, which then compiles nothing; the
    # process without warm-up compiles the one bucket its first token needs
    assert cold["warmup_compiled"] == cold["buckets"] > 1 and cold["compiled_by_first_token"] == 0
    assert cold["no_warmup_compiled"] == 1
    # a restart on each cache directory compiles nothing at all
    assert warm["warmup_compiled"] == warm["compiled_by_first_token"] == warm["no_warmup_compiled"] == 0
    assert warm["buckets"] == cold["buckets"]
    for x in (cold, warm):
        assert 0 < x["loaded_s"] <= x["ready_s"] <= x["first_token_s"] and x["no_warmup_first_token_s"] > 0
    text = bench_startup.readable({"small": r})
    assert f"small    cold  {cold['loaded_s']:7.1f}s {cold['ready_s']:7.1f}s" in text
