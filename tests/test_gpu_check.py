"""scripts/gpu_check.sh --dry-run end to end on CPU, with fastapi, uvicorn, httpx and tqdm made unimportable
(the GPU machine may lack them): the JSON's structure and its numbers against what the dry run must give."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxinfer.bench.gpu_check import DRY_RUN, NO_CUDA_GRAPHS, Clock, junit_counts, parse_args
from jaxinfer.bench.quant import MATMULS
from jaxinfer.random_model import DEFAULT

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("fastapi", "uvicorn", "httpx", "tqdm")
BLOCKER = f"""import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
sys.meta_path.insert(0, Block())
"""


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, subprocess_env) -> tuple[dict, str, subprocess.CompletedProcess, float]:
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(BLOCKER)
    out = tmp_path_factory.mktemp("out")
    env = {**subprocess_env, "PYTHON": sys.executable, "PYTHONPATH": str(site)}
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - t0
    assert (out / "gpu_check.json").is_file(), proc.stdout + proc.stderr
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text(), proc, seconds


def test_every_part_ran_and_passed(dry_run):
    r, md, proc, seconds = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["finished"] and r["dry_run"] and r["plan"] == "dry-run"
    assert 0 < r["wall_seconds"] < seconds
    parts = ("kernel_tests", "decode", "serving", "calibration", "sequence")
    assert {p: r[p]["status"] for p in parts} == dict.fromkeys(parts, "ok")
    assert r["device"]["platform"] == "cpu"
    assert r["environment"]["packages"] == {**dict.fromkeys(BLOCKED, False), "pytest": True}
    assert any("fastapi, uvicorn, httpx not importable" in n for n in r["notes"])


def test_kernel_tests(dry_run):
    k = dry_run[0]["kernel_tests"]
    assert k["interpret_mode"] and k["exit_code"] == 0
    assert (k["passed"], k["failed"], k["errors"], k["skipped"], k["failures"], k["skips"]) == (2, 0, 0, 0, [], [])


def test_decode_figures(dry_run):
    d = dry_run[0]["decode"]
    bw = d["bandwidth"]
    assert bw["copy_gbps"] > 0 and bw["read_gbps"] > 0 and bw["gbps"] == max(bw["copy_gbps"], bw["read_gbps"])
    assert [(x["batch"], x["backend"]) for x in d["results"]] == list(DRY_RUN.items)
    assert d["skipped"] == [] and d["errors"] == []
    steps = DRY_RUN.max_tokens - 1                         # the prefill step samples the first token
    layers, kv, head_dim = DEFAULT["num_hidden_layers"], DEFAULT["num_key_value_heads"], 32
    for x in d["results"]:
        assert (x["decode_steps"], x["decode_tokens"]) == (steps, x["batch"] * steps)
        if x["backend"] == "xla+int8":                     # its matmuls at one byte a weight, plus their scales
            assert x["weight_bytes_per_step"] < 0.6 * d["num_params"] * 4
        else:
            assert x["weight_bytes_per_step"] == d["num_params"] * 4     # float32, untied, one device
        context = DRY_RUN.prompt_len + (steps + 1) / 2
        assert x["kv_bytes_per_step"] == layers * x["batch"] * 2 * kv * head_dim * 4 * context
        assert x["decode_tokens_per_second"] > 0 and x["prefill_tokens_per_second"] > 0
        assert 0 < x["mbu"] < 3, x                          # a CPU's caches can beat its copy bandwidth a little
        assert x["compile_seconds"] > 0
        assert x["xla_floor_tokens_per_second"] > 0 and x["of_floor"] > 0
    # the profiled backend's smallest batch is traced once more: its costliest operations per step, on programs
    # compiled anew without CUDA graphs (an XLA option a CPU accepts and ignores)
    assert [(x["backend"], x["batch"]) for x in d["results"] if "ops" in x] == [("pallas", 1)] == [
        (k, 1) for k in DRY_RUN.profiled]
    assert [x["ops"]["xla_options"] for x in d["results"] if "ops" in x] == [NO_CUDA_GRAPHS]
    for x in d["results"]:
        if "ops" in x:
            assert x["ops"]["steps"] == steps + 1 and 0 < len(x["ops"]["ops"]) <= 8
            assert all(o["ms_per_step"] > 0 and o["runs_per_step"] > 0 for o in x["ops"]["ops"])
    k, n, rows = DRY_RUN.matmul
    assert [(m["form"], m["rows"], m["k"], m["n"]) for m in d["matmuls"]] == [(f, r, k, n) for r in rows
                                                                              for f in MATMULS]
    assert all(m["us"] > 0 and m["gbps"] > 0 for m in d["matmuls"])
    # XLA:CPU's dot reads its weight row-major: the weight laid out for the GPU's fp8 GEMM is copied back first
    # (the block-wise kernel, interpreted off a GPU, copies its operands: not counted)
    assert [m["weight_copies"] for m in d["matmuls"] if m["form"] != MATMULS[6]] == [0, 0, 1, 0, 0, 0] * len(rows)
    # int8 weights dequantized by XLA:CPU: read where they lie, neither transposed nor copied
    assert [x["one_byte_copies"] for x in d["results"] if "+" in x["backend"]] == [{"count": 0, "bytes": 0}]
    a = d["agreement"]
    assert (a["status"], a["batch"], a["sequences"], a["backends"]) == ("ok", 1, 1, ["pallas", "xla"])
    assert a["identical"] == 1   # float32 on CPU: the interpreted kernels give the reference's tokens


def test_serving_figures(dry_run):
    s = dry_run[0]["serving"]
    assert (s["completed"], s["num_requests"], s["output_tokens"], s["exact_output_lengths"]) == (1, 1, 4, True)
    assert s["output_throughput"] > 0 and s["duration_s"] > 0 and s["compilations_measured"] == 0
    assert s["attention_backend"] == "cpu"   # the C++ kernel, the CPU default


def test_calibration_figures(dry_run):
    """The planner's figures measured on the device; a CPU has no datasheet kind to set them against."""
    c = dry_run[0]["calibration"]
    got = c["measured"]
    assert got["memory_bandwidth"] > 0 and got["step_overhead"] > 0
    assert set(got["matmul_flops"]) == {"float32", "bfloat16"} and min(got["matmul_flops"].values()) > 0
    assert "assumed" not in c and "link_latency" not in got     # one device: no collective to time


def test_sequence_figures(dry_run):
    """The ring's block kernel on one device (Pallas in interpret mode here, and the jnp reference), then prefill
    and decode at sp = 1 and 4 over the eight fake devices."""
    q = dry_run[0]["sequence"]
    assert [b["kernel"] for b in q["block_kernel"]] == ["pallas", "xla"]
    assert all(b["ms"] > 0 and b["tflops"] > 0 and b["tokens"] == 64 for b in q["block_kernel"])
    assert [p["sp"] for p in q["prefill"]] == [d["sp"] for d in q["decode"]] == [1, 4]
    assert all(p["seconds"] > 0 and p["prompt_len"] == 64 for p in q["prefill"])
    assert all(d["ms_per_token"] > 0 for d in q["decode"]) and "multi_device" not in q


def test_markdown_mirrors_the_json(dry_run):
    r, md, _, _ = dry_run
    assert md.startswith("# jaxinfer GPU check (dry run on CPU)")
    for heading in ("## Kernel tests (interpret mode)", "## Decode", "## Serving (bench_serving, in-process streams)",
                    "## Calibration (the layout planner's figures)", "## Sequence parallel", "## Notes"):
        assert heading in md
    assert "- xla+int8 batch 1: 0 transposes or copies of 1-byte arrays in the decode step, 0.0 MiB written" in md
    for m in r["decode"]["matmuls"]:
        assert f"| {m['form']} | {m['k']} x {m['n']} | {m['rows']} | {m['us']:.1f} |" in md
    for x in r["decode"]["results"]:
        assert f"| {x['backend']} | {x['batch']} | {x['decode_tokens_per_second']:,.1f} | " in md
        if "ops" in x:
            top = x["ops"]["ops"][0]
            row = f"| {top['ms_per_step']:.3f} | {top['runs_per_step']:.1f} | {top['share']:.1%} | {top['name']} "
            assert row in md
    assert "Costliest device operations, pallas batch 1 without CUDA graphs (" in md
    assert f"| {r['kernel_tests']['passed']} | 0 | 0 | 0 |" in md
    assert f"| 1/1 | {r['serving']['duration_s']:.2f} |" in md
    assert f"| memory bandwidth, GB/s | {r['calibration']['measured']['memory_bandwidth'] / 1e9:.3g} | - | - |" in md


def test_parts_pass_unused_time_on():
    clock = Clock((("a", 10.0), ("b", 20.0), ("c", 5.0)), scale=2.0)
    assert [clock.deadline(p) - clock.start for p in "abc"] == [20.0, 60.0, 70.0]


def test_junit_counts(tmp_path):
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite tests="4"><testcase classname="t" name="ok"/>'
        '<testcase classname="t" name="bad"><failure message="assert 1 == 2&#10;more">x</failure></testcase>'
        '<testcase classname="t" name="boom"><error message="fixture">y</error></testcase>'
        '<testcase classname="t" name="later"><skipped message="no gpu"/></testcase></testsuite></testsuites>')
    c = junit_counts(tmp_path / "j.xml")
    assert (c["passed"], c["failed"], c["errors"], c["skipped"], c["total"]) == (1, 1, 1, 1, 4)
    assert c["failures"] == [{"test": "t::bad", "message": "assert 1 == 2"}, {"test": "t::boom", "message": "fixture"}]
    assert c["skips"] == [{"test": "t::later", "message": "no gpu"}]


def test_refuses_a_missing_output_directory(monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(SystemExit) as e:
        parse_args(["--dry-run"])
    assert e.value.code == 2 and "output directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["/tmp/x", "--budget-scale", "0"])
