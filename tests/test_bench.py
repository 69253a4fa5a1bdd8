"""The benchmark in-process on a tiny random model: its JSON fields and its byte counts, not its speed."""

import json
import math

from jaxinfer import bench
from jaxinfer.config import ModelConfig
from jaxinfer.random_model import DEFAULT, write_random_checkpoint

TINY = {**DEFAULT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_bench_json_counts(tmp_path, capsys):
    path = write_random_checkpoint(tmp_path / "tiny", TINY)
    argv = ["--model", str(path), "--batch", "1", "2", "--prompt-len", "16", "--max-tokens", "4",
            "--mesh", "tp=2", "--dtype", "float32", "--bandwidth-mib", "32", "--json"]
    assert bench.main(argv) == 0
    r = json.loads(capsys.readouterr().out)

    cfg = ModelConfig.from_dict(TINY)
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
        assert x["collectives"]["decode"]["all-reduce"]["count"] > 0  # tp=2: Megatron all-reduces per layer
    assert "all-reduce" in bench.readable(r)
