"""The benchmark in-process on a tiny random model: its JSON fields and its byte counts, not its speed."""

import json
import math

import numpy as np
import pytest

from jaxinfer.bench import decode as bench
from jaxinfer.models import config_from_dict
from jaxinfer.random_model import DEFAULT, write_random_checkpoint

TINY = {**DEFAULT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_bench_json_counts(tmp_path, capsys, random_checkpoint):
    path = random_checkpoint(TINY)
    argv = ["--model", str(path), "--batch", "1", "2", "--prompt-len", "16", "--max-tokens", "4",
            "--mesh", "tp=2", "--dtype", "float32", "--bandwidth-mib", "32", "--json",
            "--profile", str(tmp_path / "trace")]
    assert bench.main(argv) == 0
    r = json.loads(capsys.readouterr().out)

    cfg = config_from_dict(TINY)
    tp, f32 = 2, 4
    # Every weight is split over tp except the 2 * layers + 1 norm vectors, which each tp device holds whole.
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    expected_w = f32 * (cfg.num_params() + (tp - 1) * norms)
    assert r["random_weights"] is False and r["mesh"]["tp"] == tp and r["devices"] == tp
    assert r["weight_bytes_per_step"] == expected_w
    assert r["memory_bandwidth_gbps"] > 0 and "MBU" in r["mbu_formula"]
    assert [x["batch"] for x in r["results"]] == [1, 2]
    for x in r["results"]:
        b = x["batch"]
        assert x["prefill_tokens"] == b * 16
        assert x["decode_tokens"] == b * (4 - 1) and x["decode_steps"] == 4 - 1
        assert x["weight_bytes_per_step"] == expected_w
        kv_heads = cfg.num_kv_heads  # tp=2 divides the 2 KV heads: no replication
        avg_context = 16 + (x["decode_steps"] + 1) / 2
        assert x["kv_bytes_per_step"] == cfg.num_layers * b * 2 * kv_heads * cfg.head_dim * f32 * avg_context
        assert x["mbu"] > 0 and math.isfinite(x["mbu"])
        for key in ("prefill_tokens_per_second", "decode_tokens_per_second", "decode_ms_per_token",
                    "decode_bandwidth_gbps", "compile_seconds"):
            assert x[key] > 0 and math.isfinite(x[key]), key
        # tp=2: per layer one all-reduce after attention and one after the MLP, and one for the embedding; the
        # decode step's activations are [b, hidden] float32 (each request on the one replica)
        ar = x["collectives"]["decode"]["all-reduce"]
        assert ar == {"count": 2 * cfg.num_layers + 1, "bytes": (2 * cfg.num_layers + 1) * b * cfg.hidden_size * f32}
        # every part of a step was timed, and they add up to the steps' wall time (all but the bookkeeping)
        steps = x["decode_steps"] + 1      # one prefill step (16 tokens fit the step budget) and the decodes
        assert all(v > 0 for v in x["step_ms"].values()), x["step_ms"]
        host = sum(v for k, v in x["step_ms"].items() if k != "device")
        wall = (x["prefill_seconds"] + x["decode_seconds"]) * 1e3 / steps
        assert math.isclose(x["host_ms_per_step"], host) and 0 <= x["device_idle"] < 1
        assert 0.5 * wall <= host + x["step_ms"]["device"] <= wall
        assert 0 < x["host_cpu_ms_per_step"] <= wall   # one thread's CPU time within the steps' wall time
        # the XLA floor of the same decode shapes was measured, and the ratio is the engine's tok/s over it (not
        # bounded by 1 here: two timings of a tiny model on a shared machine can land either way)
        floor = x["xla_floor_tokens_per_second"]
        assert floor > 0 and math.isclose(x["of_floor"], x["decode_tokens_per_second"] / floor)
        # --profile: one more generate traced, its operations per step, the costliest first
        p = x["ops"]
        assert p["steps"] == steps and list((tmp_path / "trace" / f"batch{b}").rglob("*.xplane.pb"))
        assert len(p["ops"]) == 12 and 0 < sum(o["share"] for o in p["ops"]) <= 1
        assert [o["ms_per_step"] for o in p["ops"]] == sorted((o["ms_per_step"] for o in p["ops"]), reverse=True)
        assert all(o["runs_per_step"] > 0 for o in p["ops"])
    text = bench.readable(r).splitlines()
    for x in r["results"]:     # the table shows the JSON's figures, formatted as bench.readable formats them
        ar = x["collectives"]["decode"]["all-reduce"]
        assert f"batch {x['batch']}: decode step all-reduce {ar['count']} x, {ar['bytes']:,} bytes per device" in text
        row = next(line.split() for line in text if line.split()[:1] == [str(x["batch"])])
        assert row == [str(x["batch"]), f"{x['prefill_tokens_per_second']:.1f}", f"{x['decode_tokens_per_second']:.1f}",
                       f"{x['xla_floor_tokens_per_second']:.1f}", f"{x['of_floor']:.1%}",
                       f"{x['decode_ms_per_token']:.2f}", f"{x['decode_bandwidth_gbps']:.2f}", f"{x['mbu']:.1%}",
                       f"{x['compile_seconds']:.1f}"]
        top = x["ops"]["ops"][0]
        assert (f"{top['ms_per_step']:>9.3f} {top['runs_per_step']:>9.1f} {top['share']:>6.1%}  {top['name']} "
                f"({top['module']}): {top['source']}") in text
        # each operation named by its program (the bucket's) and, for the step's costliest, the code it came from
        assert all(o["module"].startswith("jit_step_") for o in x["ops"]["ops"]) and top["source"]
    assert f"W = {expected_w / 2**20:.1f} MiB of weight shards read per step" in text[2]
    assert text[1].startswith(f"mesh      tp=2 on 2 {r['platform']} device(s); prompt 16 tokens, 4 generated")


TINY_MOE = {**DEFAULT, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_local_experts": 4, "num_experts_per_tok": 2}


def test_bench_moe_all_to_all_and_expert_load(tmp_path, capsys):
    path = write_random_checkpoint(tmp_path / "tiny-moe", TINY_MOE)
    argv = ["--model", str(path), "--preset", "moe", "--mesh", "ep=2", "--batch", "2", "--prompt-len", "16",
            "--max-tokens", "3", "--dtype", "float32", "--bandwidth-mib", "32", "--json"]
    assert bench.main(argv) == 0
    r = json.loads(capsys.readouterr().out)

    cfg = config_from_dict(TINY_MOE)
    assert cfg.vocab_size == 264 and cfg.num_experts == 4 and cfg.moe_intermediate_size == 32
    L, E, k, f32, ep = cfg.num_layers, cfg.hidden_size, cfg.experts_per_token, 4, 2
    assert r["moe"]["moe_layers"] == L and r["moe"]["replicas"] == ep and r["devices"] == ep
    [x] = r["results"]
    assert x["batch"] == 2
    # Batch 2 over the 2 ep replicas: one sequence each, one row per device. Token bucket N per replica: the
    # 16-token prompt in one prefill step (N = 16, a prompt-step size), then 1 token per decode step (N = 1).
    # moe.py per device and MoE layer: dispatch ep*C*(E*b + 4), combine ep*C*E*b, C = N*k.
    a2a = x["moe"]["all_to_all"]
    for phase, n in (("prefill", 16), ("decode", 1)):
        a, C = a2a[phase], n * k
        expected = L * (ep * C * (E * f32 + 4) + ep * C * E * f32)
        assert a["count"] == 2 * L, phase
        assert a["bytes_per_device"] == expected == x["collectives"][phase]["all-to-all"]["bytes"], phase
        assert a["tokens"] == a["padded_tokens"] == ep * n, phase     # no bucket padding here
        assert a["bytes_per_token_per_layer"] == expected * ep / (ep * n) / L, phase
        assert a["analytical_bytes_per_token_per_layer"] == k * E * f32 * 2
        assert math.isclose(a["ratio"], ep * (1 + 2 / (E * f32))), phase   # 4 id bytes per slot
        assert math.isclose(a["run_ratio"], a["ratio"]), phase              # every step of a phase alike
    assert a2a["decode"]["run_steps"] == 3 - 1 and a2a["prefill"]["run_steps"] == 1

    load = x["moe"]
    counts = np.asarray(load["tokens_per_expert"], np.float64)
    assert counts.shape == (L, cfg.num_experts)
    # The measured run computed every prompt token and the first max_tokens - 1 sampled tokens of each
    # sequence (the warm-up run's load is subtracted); each was sent to k experts in every MoE layer.
    routed = x["prefill_tokens"] + x["decode_tokens"]
    assert routed == 2 * 16 + 2 * (3 - 1)
    assert counts.sum(axis=1).tolist() == [routed * k] * L
    imbalance = (counts.max(axis=1) / counts.mean(axis=1)).tolist()
    assert load["imbalance"] == pytest.approx(imbalance, rel=1e-12)
    assert load["imbalance_max"] == pytest.approx(max(imbalance), rel=1e-12)
    assert load["imbalance_mean"] == pytest.approx(sum(imbalance) / L, rel=1e-12)

    text = bench.readable(r).splitlines()
    for phase, n in (("prefill", 16), ("decode", 1)):
        a = a2a[phase]
        row = next(line.split() for line in text if line.split()[:2] == ["2", phase])
        assert row == ["2", phase, str(2 * L), f"{a['bytes_per_device']:,}", f"{ep * n}/{ep * n}",
                       f"{a['bytes_per_token_per_layer']:,.1f}", f"{a['analytical_bytes_per_token_per_layer']:,}",
                       f"{a['ratio']:.3f}", f"{a['run_ratio']:.3f}"]
    shown = " ".join(f"{v:.2f}" for v in imbalance)
    assert f"batch 2: expert load imbalance (max/mean per layer) {shown} (max {max(imbalance):.2f})" in text


def test_bench_pipeline_json(capsys, random_checkpoint):
    """pp 1 and 2 on a 2-layer model: memory per device, the activation hop's bytes, and utilisation at the
    formula's value (a count: the burst of 2 requests fills both slots back to back)."""
    from jaxinfer.bench import pipeline as bench_pipeline

    path = random_checkpoint(TINY)
    argv = ["--model", str(path), "--pp", "1", "2", "--requests", "2", "--prompt-len", "8", "--max-tokens", "3",
            "--dtype", "float32", "--json"]
    assert bench_pipeline.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    one, two = r["results"]
    assert (one["pp"], two["pp"]) == (1, 2) and one["batch1_slowdown"] == 1.0
    assert two["layer_bytes_per_device"] * 2 == one["layer_bytes_per_device"]
    assert two["weight_bytes_per_device"] == two["layer_bytes_per_device"] + two["embed_and_head_bytes_per_device"]
    assert two["kv_bytes_per_page_per_device"] * 2 == one["kv_bytes_per_page_per_device"]
    assert two["microbatches"] == 2 * 3 and two["burst_steps"] == 2 * 3 + 1
    assert two["utilisation"] == two["utilisation_formula"] == 6 / 7
    assert two["decode_collective_permute"] == {"count": 1, "bytes": 1 * TINY["hidden_size"] * 4}


def test_bench_sequence_json(capsys, random_checkpoint):
    """sp 1 and 2 on a 2-layer model: the ring's permutes alone in the prefill step (no context cached before
    it), the same attention kernel at both, the step's memory, a decode merge whose bytes do
    not depend on the context, KV bytes per device halved, and eta = 1 at sp=1 by definition."""
    from jaxinfer.bench import sequence as bench_sequence

    path = random_checkpoint(TINY)
    argv = ["--model", str(path), "--sp", "1", "2", "--decode-sp", "2", "--prompt-len", "32",
            "--contexts", "30", "62", "--decode-tokens", "2", "--dtype", "float32", "--json"]
    assert bench_sequence.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    L, KV = TINY["num_hidden_layers"], TINY["num_key_value_heads"]
    D = TINY["hidden_size"] // TINY["num_attention_heads"]
    one, two = r["prefill"]
    assert one["eta"] == 1.0 and one["collectives"] == {}
    assert two["eta"] == pytest.approx(one["seconds"] / (2 * two["seconds"]))
    assert two["collectives"] == {"collective-permute": {"count": L, "bytes": L * 16 * 2 * KV * D * 4}}  # no context
    assert one["backend"] == two["backend"] == "cpu" and one["temp_bytes"] > 0 and two["temp_bytes"] > 0
    short, long = r["decode"]
    assert (short["context"], long["context"]) == (30, 62) and short["x_sp1"] == long["x_sp1"] == 1.0
    assert short["collectives"] == long["collectives"] and long["collectives"]["all-to-all"]["count"] == L
    page = 2 * L * KV * 16 * D * 4                               # K and V of 16 tokens, every layer, float32
    assert (short["kv_bytes_per_device"], long["kv_bytes_per_device"]) == (1 * page, 2 * page)  # 2 and 4 pages
    # --memory-only: the same step compiled, not run (read back from the compilation cache here)
    assert bench_sequence.main([*argv[:3], "2", *argv[5:], "--memory-only"]) == 0
    r = json.loads(capsys.readouterr().out)
    (compiled,) = r["prefill"]
    assert r["decode"] == [] and "seconds" not in compiled
    assert (compiled["temp_bytes"], compiled["collectives"]) == (two["temp_bytes"], two["collectives"])


def test_moe_decode_reads_the_experts_of_its_rows():
    """W of an MoE decode step: with fewer rows than experts (1 sequence, top-2 of 4) each row reads its own
    expert, so half of each layer's experts; with as many (2 sequences) all of them."""
    from jaxinfer import LLM

    llm = LLM.random(TINY_MOE, dtype="float32", num_pages=8)
    try:
        cfg = llm.config
        experts = 4 * cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        total = bench.weight_bytes_read(llm)
        assert bench.weight_bytes_read(llm, 2) == total
        assert bench.weight_bytes_read(llm, 1) == total - experts // 2
    finally:
        llm.close()
