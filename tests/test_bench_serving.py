"""The serving benchmark in-process on a tiny random model: its accounting, not its speed."""

import json
import math

from jaxinfer.bench import serving as bench_serving
from jaxinfer.models import config_from_dict
from jaxinfer.random_model import DEFAULT

TINY = {**DEFAULT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_bench_serving_json(capsys, random_checkpoint):
    path = random_checkpoint(TINY)
    # 16-token steps force chunked prefill of the up-to-40-token prompts; 24 pages of 4 tokens (96 slots)
    # cannot hold 8 requests of up to 40 + 12 tokens, so some are preempted and recomputed. The synchronous
    # loop preempts here; the overlapped one waits for the step in flight instead (test_overlap preempts it).
    argv = ["--model", str(path), "--no-overlap", "--num-requests", "8", "--prompt-len-range", "8", "40",
            "--output-len-range", "2", "12", "--page-size", "4", "--num-pages", "24", "--max-num-seqs", "8",
            "--max-tokens-per-step", "16", "--dtype", "float32", "--seed", "3", "--json"]
    assert bench_serving.main(argv) == 0
    r = json.loads(capsys.readouterr().out)

    args = bench_serving.parse_args(argv)
    work = bench_serving.workload(args, TINY["vocab_size"], args.seed)
    assert r["completed"] == 8 and r["exact_output_lengths"] is True
    assert r["output_tokens"] == sum(n for _, _, n in work)
    assert r["prompt_tokens"] == sum(len(p) for _, p, _ in work)
    assert any(len(p) > 16 for _, p, _ in work)  # at least one prompt needs two prefill chunks
    for key in ("ttft", "tpot", "itl"):
        x = r[key]
        assert all(math.isfinite(v) and v >= 0 for v in x.values()), key
        assert x["p99_ms"] >= x["median_ms"], key
    assert r["duration_s"] > 0 and r["output_throughput"] > 0 and r["total_token_throughput"] > r["output_throughput"]
    assert 0 < r["kv_utilisation_contiguous"] <= r["kv_utilisation_paged"] <= 1
    assert r["paged_over_contiguous"] >= 1
    assert 0 < r["peak_pages_in_use"] <= r["pool_pages"] == 24
    assert r["compilations_measured"] == 0 and r["compilations_total"] > 0
    assert r["preemptions"] > 0
    assert r["num_params"] == config_from_dict(TINY).num_params() and r["max_tokens_per_step"] == 16

    # the readable block shows the JSON's figures, one "label  value" row each
    lines = bench_serving.readable(r).splitlines()
    assert "Serving Benchmark Result" in lines[0] and set(lines[-1]) == {"="}
    rows = {line[:38].strip(): line[38:] for line in lines[1:-1]}
    assert rows["Requests (rate/s)"] == "8/8 (inf)"
    assert rows["Prompt / output len ranges"] == "[8, 40] / [2, 12]"
    assert rows["Prompt / output tokens"] == f"{r['prompt_tokens']} / {r['output_tokens']}"
    assert rows["Preemptions / steps"] == f"{r['preemptions']} / {r['steps']}"
    assert rows["Prefix cache hits / queries (pages)"] == f"{r['prefix_cache_hits']} / {r['prefix_cache_queries']}"
    assert rows["Peak pages in use / pool"] == f"{r['peak_pages_in_use']} / 24"
    assert rows["Compilations measured (total)"].startswith(f"0 ({r['compilations_total']}), ")
    assert rows["Request throughput (req/s)"] == f"{r['request_throughput']:.2f}"
    assert rows["Output token throughput (tok/s)"] == f"{r['output_throughput']:.1f}"
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
        x = r[key]
        assert rows[f"{label} mean/median/p99 (ms)"] == f"{x['mean_ms']:.1f} / {x['median_ms']:.1f} / {x['p99_ms']:.1f}"
    assert rows["KV util paged / contiguous"].startswith(
        f"{r['kv_utilisation_paged']:.1%} / {r['kv_utilisation_contiguous']:.1%}")


def test_bench_serving_http_matches_in_process(capsys, monkeypatch, random_checkpoint):
    """--http: the same workload in-process and over HTTP; every token arrives both ways, in order."""
    from jaxinfer.tokenizer import IncrementalDetokenizer

    class IdText(IncrementalDetokenizer):
        """Each token's text is "<id>", so the texts a client receives name the token ids."""

        def add(self, token_id: int) -> str:
            super().add(token_id)
            return f"<{token_id}>"

        def finish(self) -> str:
            super().finish()
            return ""

    records = []  # (records, figures) of each measured pass: in-process, then HTTP

    def spy(*args, **kwargs):
        records.append(measure(*args, **kwargs))
        return records[-1]

    measure = bench_serving.measure
    monkeypatch.setattr("jaxinfer.engine.core.IncrementalDetokenizer", IdText)
    monkeypatch.setattr(bench_serving, "measure", spy)
    path = random_checkpoint(TINY)
    argv = ["--model", str(path), "--http", "--num-requests", "5", "--concurrency", "3", "--prompt-len-range", "4",
            "24", "--output-len-range", "2", "8", "--dtype", "float32", "--seed", "1", "--json"]
    assert bench_serving.main(argv) == 0
    r = json.loads(capsys.readouterr().out)

    args = bench_serving.parse_args(argv)
    lengths = [n for _, _, n in bench_serving.workload(args, TINY["vocab_size"], args.seed)]
    assert r["concurrency"] == 3 and r["outputs_match"] is True
    for way in ("in_process", "http"):
        x = r[way]
        assert x["output_tokens"] == sum(lengths) and x["exact_output_lengths"] is True, way
        assert x["duration_s"] > 0 and x["output_throughput"] > 0 and x["request_throughput"] > 0, way
        for key in ("ttft", "itl"):
            assert all(math.isfinite(v) and v >= 0 for v in x[key].values()), (way, key)
            assert x[key]["p99_ms"] >= x[key]["median_ms"], (way, key)
    vs = r["http_over_in_process"]
    assert vs["throughput_ratio"] == r["http"]["output_throughput"] / r["in_process"]["output_throughput"]
    assert vs["ttft_median_diff_ms"] == r["http"]["ttft"]["median_ms"] - r["in_process"]["ttft"]["median_ms"]

    (local, _), (remote, _) = records
    ids = [[[int(t[1:-1]) for t in rec.texts] for rec in way] for way in (local, remote)]
    assert [len(i) for i in ids[0]] == lengths
    assert ids[1] == ids[0]  # the greedy tokens received over HTTP are those streamed in-process
    assert all(rec.times[0] - rec.sent > 0 for way in (local, remote) for rec in way)  # every TTFT

    lines = bench_serving.readable_http(r).splitlines()
    rows = {line[:34].strip(): line[34:].split() for line in lines[1:-1]}
    assert rows[""] == ["in-process", "HTTP", "HTTP/in-process"]
    assert rows["Output tokens"] == [str(sum(lengths))] * 2
    assert rows["Output token throughput (tok/s)"][2] == f"x{vs['throughput_ratio']:.3f}"
    assert rows["Outputs match"] == ["yes"]
