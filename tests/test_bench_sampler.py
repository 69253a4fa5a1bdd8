"""`python -m jaxinfer.bench.sampler` prints a timing per sampler case, and refuses empty shapes."""

import json

import pytest

from jaxinfer.bench import sampler as bench_sampler


def test_bench_sampler_times_every_case(capsys):
    assert bench_sampler.main(["--batch", "2", "--vocab", "64", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["batch"], row["vocab"]) == (2, 64)
    keys = ("greedy_ms", "temperature_ms", "top_k_top_p_ms", "top_k_top_p_by_row_ms", "one_drawing_ms",
            "one_drawing_by_row_ms", "filters_ms", "full_sort_ms")
    assert all(row[k] > 0 for k in keys)


def test_bench_sampler_refuses_an_empty_batch(capsys):
    with pytest.raises(SystemExit):
        bench_sampler.main(["--batch", "0"])
    assert "--batch must be at least 1" in capsys.readouterr().err
