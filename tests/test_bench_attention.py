"""`python -m jaxinfer.bench.attention` times the CPU kernel and the reference on the same step, and their
outputs agree."""

import json

import pytest

from jaxinfer.bench import attention as bench_attention


def test_bench_attention_times_both_sides_of_a_case(capsys):
    assert bench_attention.main(["--case", "decode 8 x 64", "--case", "prompt 256", "--rounds", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["case"] for r in rows] == ["decode 8 x 64", "prompt 256"]
    assert [(r["tokens"], r["sequences"]) for r in rows] == [(8, 8), (256, 1)]
    for r in rows:
        assert r["kernel_ms"] > 0 and r["reference_ms"] > 0
        assert r["speedup"] == pytest.approx(r["reference_ms"] / r["kernel_ms"])
        assert r["error"] < 1e-5


def test_bench_attention_refuses_unknown_cases_and_no_rounds(capsys):
    with pytest.raises(SystemExit):
        bench_attention.main(["--case", "decode 1 x 1"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_attention.main(["--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err
