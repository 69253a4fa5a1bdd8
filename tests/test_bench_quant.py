"""`python -m jaxinfer.bench.quant` on the llama fixture: every row's figures are what they claim."""

import json

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.bench import quant
from jaxinfer.config import EngineConfig
from jaxinfer.mesh import MeshConfig
from jaxinfer.models import config_from_dir
from jaxinfer.plan import Workload
from jaxinfer.plan.compiled import compile_layout
from jaxinfer.plan.hardware import device_kind
from jaxinfer.plan.planner import evaluate


def test_rows_report_bytes_capacity_and_accuracy(hf_tiny, capsys):
    cfg = json.loads((hf_tiny / "llama" / "config.json").read_text())
    head_dim = cfg["head_dim"]
    assert quant.main(["--model", str(hf_tiny / "llama"), "--variants", "int8", "kv-fp8", "--prompts", "2",
                       "--prompt-len", "8", "--max-tokens", "4", "--bandwidth-mib", "16", "--rounds", "3",
                       "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    base, int8, kv = r["rows"]
    assert [x["variant"] for x in r["rows"]] == ["float32", "int8", "kv-fp8"]
    for x in r["rows"]:   # the medians of three turns each, the ratio the median of the three rounds' own
        assert len(x["decode_rounds"]) == 3 and x["decode_tokens_per_second"] == sorted(x["decode_rounds"])[1]
        ratios = sorted(a / b for a, b in zip(x["decode_rounds"], base["decode_rounds"], strict=True))
        assert x["speedup"] == ratios[1] and x["speedup_range"] == [ratios[0], ratios[2]]
    assert all(x["speedup_vs_bfloat16"] is None for x in r["rows"])   # no bfloat16 row to compare with
    table = quant.readable(r).splitlines()
    assert "x bf16" in table[1] and table[3].split()[:6] == [
        "int8", f"{int8['weight_bytes_per_device'] / 2**20:.1f}", str(int8["kv_tokens_per_gib"]),
        f"{int8['decode_tokens_per_second']:.1f}", f"{int8['speedup']:.2f}", "-"]
    assert base["kl_max"] == 0 and base["max_logit_error"] == 0 and base["greedy_agreement"] == 1
    # int8 matmuls: a quarter of their float32 bytes plus a float32 scale per output column; the rest as it was
    assert int8["weight_bytes_per_device"] < 0.6 * base["weight_bytes_per_device"]
    assert int8["weight_bytes_per_step"] == int8["weight_bytes_per_device"]          # one device
    # fp8 pages: a byte per element and a bfloat16 scale per vector, against 4 bytes per element
    assert kv["kv_bytes_per_token"] * (4 * head_dim) == base["kv_bytes_per_token"] * (head_dim + 2)
    assert kv["kv_tokens_ratio"] == (2**30 // kv["kv_bytes_per_token"]) / (2**30 // base["kv_bytes_per_token"])
    for x in (int8, kv):
        assert 0 < x["kl_mean"] <= x["kl_max"] < 0.02 and 0 < x["max_logit_error"] and x["greedy_agreement"] > 0.5
        assert x["decode_tokens_per_second"] > 0 and x["speedup"] > 0
    # beside each, the planner's decode tok/s for the variant as served: int8's weights are fewer bytes, each read
    # at int8's rate on this machine's device kind; the fp8 KV row holds float32's weights
    kind = device_kind("cpu", len(jax.devices()))
    cfg = config_from_dir(hf_tiny / "llama")
    for x, q in ((base, None), (int8, "int8")):
        planned = compile_layout(cfg, MeshConfig(), jnp.float32, EngineConfig(quantization=q), 1, programs=False)
        workload = Workload(prompt=8, output=4, concurrency=1)
        est = evaluate(cfg, MeshConfig(), kind, workload, jnp.float32, EngineConfig(quantization=q), planned,
                       programs=False).estimate
        assert x["predicted_decode_tokens_per_second"] == pytest.approx(1 / est.tpot_s, rel=1e-9)
    assert int8["predicted_decode_tokens_per_second"] != base["predicted_decode_tokens_per_second"]
    assert table[3].split()[6] == f"{int8['speedup_range'][0]:.2f}-{int8['speedup_range'][1]:.2f}"
    assert table[3].split()[8] == f"{int8['predicted_decode_tokens_per_second']:.1f}"


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        quant.parse_args(["--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_the_ratio_to_bfloat16_is_each_rows_own():
    # three rounds: the machine slows down in the second and third, alike for every variant
    rows = [{"variant": v, "decode_rounds": t} for v, t in (("float32", [40.0, 20.0, 10.0]),
                                                            ("bfloat16", [32.0, 16.0, 10.0]),
                                                            ("int8", [48.0, 30.0, 16.0]))]
    ratios = quant.ratios(rows)
    assert [r["speedup"] for r in ratios] == [1.0, 0.8, 1.5]
    assert [r["speedup_range"] for r in ratios] == [(1.0, 1.0), (0.8, 1.0), (1.2, 1.6)]
    assert [r["speedup_vs_bfloat16"] for r in ratios] == [1.25, 1.0, 1.6]
