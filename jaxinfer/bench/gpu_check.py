"""`python -m jaxinfer.bench.gpu_check OUTDIR` (or `bash scripts/gpu_check.sh OUTDIR`): what a first run on one GPU
must tell, within a fixed time (490 s), written as OUTDIR/gpu_check.json and OUTDIR/gpu_check.md.

Parts, in this order, each with a time budget (an unused budget passes to the next part; what no longer
fits is skipped with a note; both files are rewritten after every measured item, so a run cut short still
leaves what it measured, with "finished": false):

1. kernel_tests: tests/test_ragged_paged_attention.py, test_rope_cache.py, test_block_attention.py and
   test_block_matmul.py under pytest in a child process with JAX_PLATFORMS=cuda, so the Pallas kernels
   compile through Triton and run on the GPU (on CPU the same tests run them in interpret mode; float32 dots
   in full precision either way, not TF32); pass / fail / error / skip counts and the failures. It runs
   before this process touches the GPU.
2. decode: first one 4096 x 28672 weight's matmul alone at 1 and 32 rows in each form the engine may run it
   (jaxinfer.bench.quant.weight_matmuls: bfloat16, the fp8 GEMM on the weight stored row-major and
   contraction-minor, int8 dequantize-then-matmul and int8 matmul-then-scale, fp8 in blocks of 128 by XLA's
   products per block and by the Pallas kernel): time, GB/s, and the
   weight-sized transposes and copies XLA put in the program. Then a Llama-3-8B-shaped model
   (random_model.LLAMA3_8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocabulary 128256) with
   random bfloat16 weights drawn on the device (LLM.random: nothing is written to disk), one engine per
   attention backend (pallas, xla) and two more with the matmul weights quantized as they load ("pallas+fp8":
   on Hopper an fp8 GEMM per matmul, `fp8_gemm` says whether the device has one; "pallas+int8":
   dequantize-then-matmul), all from the same seed: jaxinfer.bench.decode.bench_batch (a warm-up generate
   with the same shapes, then the measured one; prompt 128 tokens, 64 new, greedy; the step budget holds
   every prompt, so each decode step carries the whole batch) at batch 1 for all four, then at 32 and 128
   for pallas and xla. Decode tok/s, ms per step, and MBU = (W + K) / step time / bandwidth, where W =
   weight bytes, K = KV bytes at the average decode context (bench.py's docstring) and bandwidth = the
   better of an on-device copy (read + write bytes) and an on-device sum (read bytes) of a 2 GiB buffer
   (bench.device_bandwidth); the XLA floor of the same shapes (bench.xla_floor: the layers straight-line,
   without attention, sampling or host work) with the engine's share of it ("of floor": what the engine's
   loop over layers, attention and sampler cost); for each quantized engine, the 1-byte transposes and
   copies in its decode step. Each backend's batch-1 generate is traced once more for its costliest
   operations, pallas's on programs compiled without CUDA graphs (NO_CUDA_GRAPHS), whose kernels a trace
   cannot otherwise see. Last, both attention backends decode the same greedy prompts at the largest batch
   <= 32 both measured (shapes already compiled): how many outputs agree token for token (with random
   weights, near-ties in bfloat16 may flip a token; this is a sign, not a test).
3. serving: jaxinfer.bench.serving's in-process workload on the same model shape (attention backend: auto):
   32 requests at t=0, prompts 64-128 and outputs 32-64 tokens, step budget 2048 (six step shapes to compile
   at most, as counted on CPU). The HTTP layer is not measured here (bench_serving --http needs fastapi,
   uvicorn and httpx; the report says which of them are importable).
4. calibration: the layout planner's figures measured on the device (jaxinfer.plan.calibrate.measure: memory
   bandwidth, float32 and bfloat16 matmul rates, the engine's host work per step), set against the
   datasheet-based figures the planner assumes for that device kind (jaxinfer.plan.hardware).

5. sequence: the ring's block kernel alone (pallas_kernels/block_attention.py: a rank's chunk pair over a
   passing block, every key visible; Pallas and the jnp reference), which one GPU can show; then, on two
   devices or more, one prompt's prefill and 16 decoded tokens at sp = 1 and sp = min(4, devices).

--dry-run: the same parts end to end on CPU at tiny shapes: the embedded default model's shape in float32,
xla at batch 1 and 2, pallas (interpret mode) and xla with int8 weights at batch 1, a two-test subset of the
kernel tests, one serving request. Its prompts are one token long, so a prefill step has a decode step's shapes and each
engine compiles one executable per batch size: the dry run checks that everything runs, not what it measures.

Exit status: 0 when every part ran and passed, 1 when one failed or was skipped, 2 for bad arguments,
124 when stopped by SIGTERM (e.g. `timeout`) before the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from jaxinfer.random_model import DEFAULT, LLAMA3_8B

REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ("tests/test_ragged_paged_attention.py", "tests/test_rope_cache.py", "tests/test_block_attention.py",
                "tests/test_block_matmul.py", "tests/test_grouped_matmul.py")
HTTP_PACKAGES = ("fastapi", "uvicorn", "httpx")    # bench_serving --http / --url only
OTHER_PACKAGES = ("tqdm", "pytest")
SPEC_GBPS = {"H200": 4800.0, "H100": 3350.0}      # vendors' datasheets (SXM), for reference only


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures, and how long each part may take (seconds)."""

    name: str
    model: dict                    # a config.json dict
    model_label: str
    dtype: str
    platform: str                  # JAX_PLATFORMS of the kernel tests
    kernel_tests: tuple[str, ...]  # pytest arguments
    items: tuple[tuple[int, str], ...]  # (batch, attention backend[+weight quantization]) in the order they run
    profiled: tuple[str, ...]      # the backends whose smallest batch is traced once more (jax.profiler)
    prompt_len: int
    max_tokens: int
    num_pages: int                 # KV pages per engine: every batch's sequences at full length, and room
    bandwidth_mib: int
    serving: tuple[str, ...]       # bench_serving flags
    budgets: tuple[tuple[str, float], ...]
    serving_minimum: float         # seconds the serving part needs at least to be started
    probe: tuple[int, int, int]    # calibration: float32 words of the bandwidth probe, the matmul's m and k
    block: tuple[int, int, int, int]  # sequence: the ring block kernel's tokens (queries = keys), heads, kv heads, dim
    sp_prompt_len: int             # sequence: the prompt prefilled at sp = 1 and sp > 1 (two devices or more)
    matmul: tuple[int, int, tuple[int, ...]]  # decode: one weight's K, N and the activation rows it is timed at


GPU = Plan(
    name="gpu", model=LLAMA3_8B, model_label="Llama-3-8B shape", dtype="bfloat16", platform="cuda",
    kernel_tests=KERNEL_TESTS, items=((1, "pallas"), (1, "pallas+fp8"), (1, "pallas+int8"), (1, "xla"),
                                      *((b, k) for b in (32, 128) for k in ("pallas", "xla"))),
    profiled=("pallas", "pallas+fp8", "pallas+int8", "xla"),
    prompt_len=128, max_tokens=64,
    num_pages=2048, bandwidth_mib=2048,
    serving=("--num-requests", "32", "--prompt-len-range", "64", "128", "--output-len-range", "32", "64",
             "--max-tokens-per-step", "2048", "--num-pages", "2048"),
    budgets=(("kernel_tests", 110.0), ("decode", 275.0), ("serving", 75.0), ("calibration", 15.0),
             ("sequence", 15.0)),
    serving_minimum=45.0, probe=(256 << 20, 8192, 8192), block=(4096, 32, 8, 128), sp_prompt_len=4096,
    matmul=(4096, 28672, (1, 32)))

DRY_RUN = Plan(
    name="dry-run", model=DEFAULT, model_label="embedded default shape", dtype="float32", platform="cpu",
    kernel_tests=(*KERNEL_TESTS, "-k", "test_reference_and_kernel and gqa3 or test_kernel_matches_reference and "
                  "float32-1"),
    items=((1, "pallas"), (1, "xla"), (1, "xla+int8")), profiled=("pallas",), prompt_len=1,
    max_tokens=8, num_pages=64,
    bandwidth_mib=8,
    serving=("--num-requests", "1", "--prompt-len-range", "1", "1", "--output-len-range", "4", "4",
             "--num-pages", "64"),
    budgets=(("kernel_tests", 300.0), ("decode", 300.0), ("serving", 300.0), ("calibration", 300.0),
             ("sequence", 300.0)),
    serving_minimum=0.0, probe=(1 << 16, 64, 256), block=(64, 4, 2, 16), sp_prompt_len=64,
    matmul=(64, 256, (1,)))


class TimeUp(BaseException):
    """SIGTERM (the wrapper's `timeout`): stop wherever we are, write what we have."""


class Clock:
    """Deadlines of the parts: a part may run until the total budget minus the budgets of the parts after it."""

    def __init__(self, budgets: tuple[tuple[str, float], ...], scale: float = 1.0):
        self.start = time.monotonic()
        self.budgets = [(name, seconds * scale) for name, seconds in budgets]

    def deadline(self, part: str) -> float:
        names = [name for name, _ in self.budgets]
        return self.start + sum(s for _, s in self.budgets[: names.index(part) + 1])

    def left(self, part: str) -> float:
        return self.deadline(part) - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class Report:
    """The one JSON object and its markdown rendering, rewritten in full on every save."""

    def __init__(self, outdir: Path, plan: Plan):
        self.outdir = outdir
        self.data: dict[str, Any] = {
            "check": "jaxinfer gpu_check", "plan": plan.name, "dry_run": plan is DRY_RUN, "finished": False,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "wall_seconds": 0.0,
            "environment": environment(), "budgets_s": dict(plan.budgets), "notes": [], "warnings": [],
            "kernel_tests": {"status": "not run"}, "decode": {"status": "not run"}, "serving": {"status": "not run"},
            "calibration": {"status": "not run"}, "sequence": {"status": "not run"},
        }
        self.t0 = time.monotonic()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)

    def save(self) -> None:
        self.data["wall_seconds"] = time.monotonic() - self.t0
        self.outdir.mkdir(parents=True, exist_ok=True)
        for name, text in (("gpu_check.json", json.dumps(self.data, indent=1, default=str)),
                           ("gpu_check.md", markdown(self.data))):
            tmp = self.outdir / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(self.outdir / name)


# ---- environment ------------------------------------------------------------------------------------------
def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def environment() -> dict:
    """Versions and optional packages: nothing here starts a JAX backend."""
    plugins = {d: version_of(d) for d in ("jax-cuda12-plugin", "jax-cuda13-plugin")}
    return {"python": platform.python_version(), "jax": version_of("jax"), "jaxlib": version_of("jaxlib"),
            "jax_cuda_plugin": {d: v for d, v in plugins.items() if v}, "jaxinfer_from": str(REPO),
            "packages": {p: importable(p) for p in (*HTTP_PACKAGES, *OTHER_PACKAGES)}}


def devices() -> dict:
    import jax

    d = jax.devices()[0]
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    return {"platform": d.platform, "device_kind": d.device_kind, "device_count": jax.device_count(),
            "memory_bytes_limit": (stats or {}).get("bytes_limit")}


# ---- part 1: the kernel tests ------------------------------------------------------------------------------
def kernel_tests(plan: Plan, seconds: float) -> dict:
    """pytest -v on the kernel test files in a child process: counts from its JUnit XML, or, when it ran past
    the part's time and wrote none, from the outcome lines it printed until then."""
    if not importable("pytest"):
        return {"status": "skipped", "reason": "pytest is not importable"}
    if not all((REPO / f).is_file() for f in KERNEL_TESTS):
        return {"status": "skipped", "reason": f"{', '.join(KERNEL_TESTS)} not found under {REPO} (an install "
                "without the source tree?)"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}",
               *plan.kernel_tests]
        env = {**os.environ, "JAX_PLATFORMS": plan.platform, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
               "PYTHONSAFEPATH": "1",               # the package as installed (or linked), never the checkout's
               "JAXINFER_FIXTURES_OPTIONAL": "1"}   # ../shared may not have come along: skip what needs it
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(seconds, 1))
            output, timed_out, code = proc.stdout + proc.stderr, False, proc.returncode
        except subprocess.TimeoutExpired as e:
            output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                             for x in (e.stdout, e.stderr))
            timed_out, code = True, None
        result = {"seconds": time.monotonic() - t0, "command": " ".join(cmd), "exit_code": code,
                  "interpret_mode": plan.platform == "cpu",
                  "triton_deprecation_warning": "Pallas Triton backend is deprecated" in output}
        result.update(junit_counts(xml) if xml.is_file() else verbose_counts(output))
    bad = result["failed"] + result["errors"]
    if timed_out:
        result.update(status="timeout", reason=f"pytest ran past the part's {seconds:.0f} s; counts are of the "
                      "tests finished by then")
    else:
        result["status"] = "ok" if bad == 0 and result["passed"] > 0 and code == 0 else "failed"
    if bad or result["status"] != "ok":
        result["output_tail"] = output[-3000:]
    return result


OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.MULTILINE)


def verbose_counts(output: str) -> dict:
    """The counts of junit_counts from pytest -v's outcome lines (an error in teardown counts as an error)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": []}
    key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
           "XFAIL": "skipped"}
    for test, outcome in OUTCOME.findall(output):
        counts[key[outcome]] += 1
        if outcome in ("FAILED", "ERROR"):
            counts["failures"].append({"test": test, "message": outcome.lower()})
    counts["total"] = sum(counts[k] for k in ("passed", "failed", "errors", "skipped"))
    return counts


def junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped, and the test and first message line of each failure and skip."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": []}
    for case in root.iter("testcase"):
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped", None: "passed"}[
            outcome.tag if outcome is not None else None]
        counts[key] += 1
        if outcome is not None:
            lines = (outcome.get("message") or outcome.text or "").strip().splitlines()
            counts["skips" if key == "skipped" else "failures"].append(
                {"test": f"{case.get('classname')}::{case.get('name')}", "message": lines[0][:300] if lines else ""})
    counts["total"] = sum(counts[k] for k in ("passed", "failed", "errors", "skipped"))
    return counts


# ---- part 2: decode tok/s and MBU ----------------------------------------------------------------------------
DECODE_KEYS = ("batch", "decode_tokens_per_second", "decode_ms_per_token", "decode_steps", "decode_tokens",
               "mbu", "decode_bandwidth_gbps", "weight_bytes_per_step", "kv_bytes_per_step", "avg_decode_context",
               "prefill_tokens_per_second", "prefill_tokens", "compile_seconds", "step_ms", "host_ms_per_step",
               "device_idle", "xla_floor_tokens_per_second", "of_floor")


def decode(plan: Plan, clock: Clock, report: Report) -> None:
    """Bandwidth, then bench_batch per (batch, backend) while the part's time lasts, then the agreement."""
    from jaxinfer.bench.decode import bench_batch, device_bandwidth
    from jaxinfer.bench.quant import one_byte_copies, weight_matmuls
    from jaxinfer.config import EngineConfig
    from jaxinfer.models import config_from_dict

    part = report.data["decode"] = {
        "status": "running", "model": plan.model_label, "num_params": config_from_dict(plan.model).num_params(),
        "dtype": plan.dtype, "prompt_len": plan.prompt_len, "max_tokens": plan.max_tokens,
        "items": [list(i) for i in plan.items], "results": [], "skipped": [], "errors": []}
    bandwidth = device_bandwidth(mib=plan.bandwidth_mib)
    kind = next((k for k in SPEC_GBPS if k in bandwidth["device_kind"]), None)
    part["bandwidth"] = {**bandwidth, "spec_gbps": SPEC_GBPS.get(kind)}
    report.save()
    k, n, rows = plan.matmul
    part["matmuls"] = [x for m in rows for x in guarded(part, f"weight matmuls, {m} rows", weight_matmuls, k, n, m,
                                                        plan.dtype) or ()]
    report.save()
    largest = max(b for b, _ in plan.items)
    config = EngineConfig(num_pages=plan.num_pages, max_num_seqs=largest, max_tokens_per_step=largest * plan.prompt_len,
                          compilation_cache=False)
    llms, cost = {}, {}
    try:
        for backend in dict.fromkeys(k for _, k in plan.items):
            llm = guarded(part, f"{backend}: building the engine", random_llm, plan, config, backend)
            if llm is not None:
                llms[backend] = llm
        report.save()
        for batch, backend in plan.items:
            llm = llms.get(backend)
            if llm is None:
                continue                                   # its engine failed to build: noted above
            left, need = clock.left("decode"), 1.25 * cost.get(backend, 0.0)   # larger batches cost more
            if need > left:
                reason = f"time budget: {left:.0f} s left in the decode part, the last {backend} item took " \
                         f"{cost[backend]:.0f} s"
                part["skipped"].append({"backend": backend, "batch": batch, "reason": reason})
                continue
            t0 = time.monotonic()
            row = guarded(part, f"{backend} batch {batch}", bench_batch, llm, batch, plan.prompt_len,
                          plan.max_tokens, seed=batch, bandwidth=bandwidth["gbps"])
            cost[backend] = time.monotonic() - t0
            if row is not None:
                part["results"].append({"backend": backend, **{k: row[k] for k in DECODE_KEYS},
                                        "wall_seconds": cost[backend]})
                if "+" in backend:   # quantized weights: what XLA transposes or copies of them each step
                    part["results"][-1]["one_byte_copies"] = one_byte_copies(llm.engine.runner.last["decode"].as_text())
                smallest = batch == min(b for b, k in plan.items if k == backend)
                if backend in plan.profiled and smallest and clock.left("decode") > cost[backend]:
                    traces = report.outdir / "traces" / f"{backend}-b{batch}"
                    options = NO_CUDA_GRAPHS if backend == "pallas" else None   # the headline's kernels seen
                    part["results"][-1]["ops"] = guarded(part, f"{backend} batch {batch}: profile", profile_decode,
                                                         plan, llm, batch, traces, options)
            report.save()
        if any(k.endswith("+fp8") for k in llms):
            from jaxinfer.device.matmul import has_fp8_gemm

            part["fp8_gemm"] = has_fp8_gemm(next(iter(llms.values())).layout)   # else dequantize-then-matmul
        plain = {k: v for k, v in llms.items() if "+" not in k}   # the attention backends, same weights
        part["agreement"] = guarded(part, "backend agreement", agreement, plan, plain, part, clock)
    finally:
        for llm in llms.values():
            llm.close()
        llms.clear()
        gc.collect()
    part["status"] = "ok" if not part["errors"] and not part["skipped"] else "partial" if part["results"] else "failed"


NO_CUDA_GRAPHS = {"xla_gpu_enable_command_buffer": ""}   # XLA runs a GPU step as CUDA graphs, opaque to a trace


def profile_decode(plan: Plan, llm, batch: int, directory: Path, options: dict | None = None) -> dict:
    """The benchmark's generate once more under jax.profiler (bench --profile): the costliest device
    operations per step, and the trace in `directory` for xprof or TensorBoard; with XLA `options`, on
    programs compiled anew with them (ModelRunner.compiled_with)."""
    from jaxinfer.bench.decode import profile_ops
    from jaxinfer.bench.peers import bench_prompts
    from jaxinfer.sampling import SamplingParams

    _, prompts = bench_prompts(llm.config.vocab_size, batch, plan.prompt_len, seed=batch)
    with llm.engine.runner.compiled_with(**(options or {})):
        ops = profile_ops(llm, prompts, SamplingParams(max_tokens=plan.max_tokens, temperature=0, ignore_eos=True),
                          directory, top=8)
    return {**ops, "xla_options": options or {}}


def random_llm(plan: Plan, config, backend: str):
    """The engine of an item's backend key: "pallas", "xla", or "pallas+fp8" (its matmul weights quantized
    as they load: on Hopper, fp8 GEMMs)."""
    from jaxinfer.llm import LLM

    attention, _, quantization = backend.partition("+")
    return LLM.random(plan.model, dtype=plan.dtype, seed=0, engine_config=dataclasses.replace(
        config, attention_backend=attention, quantization=quantization or None))


def guarded(part: dict, what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) or, if it raises, None with the error noted in the part (one item's failure is not
    the run's)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        part["errors"].append({"what": what, "error": f"{type(e).__name__}: {e}"[:1000],
                               "traceback_tail": traceback.format_exc()[-2000:]})
        return None


def agreement(plan: Plan, llms: dict, part: dict, clock: Clock) -> dict:
    """The backends' greedy outputs for the same prompts, at a batch whose shapes both compiled."""
    import numpy as np

    from jaxinfer.sampling import SamplingParams

    done = {(r["backend"], r["batch"]) for r in part["results"]}
    common = [b for b, k in plan.items if k in llms and b <= 32 and all((name, b) in done for name in llms)]
    if len(llms) < 2 or not common:
        return {"status": "skipped", "reason": "not every backend measured a batch <= 32"}
    if clock.left("decode") < 0:
        return {"status": "skipped", "reason": "time budget of the decode part spent"}
    batch = max(common)
    first = next(iter(llms.values()))
    prompts = np.random.default_rng(1234).integers(0, first.config.vocab_size, (batch, plan.prompt_len)).tolist()
    params = SamplingParams(max_tokens=plan.max_tokens, temperature=0, ignore_eos=True)
    outputs = {name: [c.token_ids for c in llm.generate(prompts, params)] for name, llm in llms.items()}
    a, b = outputs.values()

    def common_prefix(x: list[int], y: list[int]) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))

    prefixes = [common_prefix(x, y) for x, y in zip(a, b, strict=True)]
    return {"status": "ok", "batch": batch, "backends": list(outputs), "sequences": batch,
            "identical": sum(p == plan.max_tokens for p in prefixes),
            "first_token_equal": sum(p > 0 for p in prefixes),
            "mean_common_prefix": float(np.mean(prefixes)), "tokens_per_sequence": plan.max_tokens}


# ---- part 3: the serving benchmark ----------------------------------------------------------------------------
SERVING_KEYS = ("attention_backend", "num_requests", "request_rate", "prompt_len_range", "output_len_range",
                "max_num_seqs", "max_tokens_per_step", "completed", "exact_output_lengths", "duration_s",
                "prompt_tokens", "output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
                "ttft", "tpot", "itl", "preemptions", "steps", "compilations_total", "compilations_measured",
                "warmup_s", "kv_utilisation_paged", "kv_utilisation_contiguous", "peak_pages_in_use", "pool_pages")


def serving(plan: Plan, clock: Clock, report: Report) -> None:
    from jaxinfer.bench import serving as bench_serving
    from jaxinfer.config import EngineConfig
    from jaxinfer.llm import LLM

    left = clock.left("serving")
    if left < plan.serving_minimum:
        report.data["serving"] = {"status": "skipped", "reason": f"time budget: {left:.0f} s left, the serving "
                                  f"part needs at least {plan.serving_minimum:.0f} s"}
        return
    part = report.data["serving"] = {"status": "running", "model": plan.model_label, "errors": [],
                                     "flags": " ".join(plan.serving), "in_process": True}
    args = bench_serving.parse_args([*plan.serving, "--no-compilation-cache"])
    t0 = time.monotonic()
    llm = guarded(part, "building the engine", LLM.random, plan.model, dtype=plan.dtype, seed=0,
                  engine_config=EngineConfig.from_cli_args(args))
    if llm is None:
        part["status"] = "failed"
        return
    try:
        result = guarded(part, "serving the workload", bench_serving.measure_serving, llm,
                         f"{plan.model_label} (random weights)", args)
    finally:
        llm.close()
    part["wall_seconds"] = time.monotonic() - t0
    if result is not None:
        part.update({k: result[k] for k in SERVING_KEYS})
    part["status"] = "ok" if result is not None else "failed"


def calibration(plan: Plan, clock: Clock, report: Report) -> None:
    """The planner's figures measured here, beside the ones it assumes for this device kind."""
    import jax

    from jaxinfer.plan.auto import local_device_kind
    from jaxinfer.plan.calibrate import measure
    from jaxinfer.plan.hardware import KINDS

    part = report.data["calibration"] = {"status": "running", "errors": []}
    words, m, k = plan.probe
    device = jax.devices()[0]
    measured = guarded(part, "measuring", measure, [device], words=words, m=m, k=k)
    if measured is None:
        part["status"] = "failed"
        return
    part["measured"] = measured
    try:
        kind = KINDS.get(local_device_kind(device))
    except ValueError:   # a GPU the planner has no figures for
        kind = None
    if kind is not None:
        assumed = {"memory_bandwidth": kind.memory_bandwidth, "step_overhead": kind.step_overhead,
                   "matmul_flops": {d: kind.rate(d) for d in measured["matmul_flops"]}}
        part.update(kind=kind.name, source=kind.source, assumed=assumed)
    part["seconds_left"] = clock.left("calibration")
    part["status"] = "ok"


# ---- part 5: sequence parallel ---------------------------------------------------------------------------------
def sequence(plan: Plan, clock: Clock, report: Report) -> None:
    """The ring's block kernel alone (what each rank does with a passing K/V block; one device suffices), then,
    on two devices or more, one prompt's prefill and one sequence's decode at sp = 1 and sp = min(4, devices)."""
    import jax

    part = report.data["sequence"] = {"status": "running", "errors": [], "block_kernel": [], "prefill": [],
                                      "decode": []}
    for kernel in ("pallas", "xla"):
        row = guarded(part, f"block kernel {kernel}", time_block_kernel, plan, kernel)
        if row is not None:
            part["block_kernel"].append(row)
        report.save()
    count = jax.device_count()
    if count < 2:
        part["multi_device"] = f"not run: {count} device; sp needs two or more"
    for sp in (1, min(4, count)) if count >= 2 else ():
        if clock.left("sequence") <= 0:
            part["multi_device"] = f"not run at sp={sp}: time budget"
            break
        guarded(part, f"sp={sp}", sp_prefill_and_decode, plan, sp, part)
        report.save()
    part["seconds_left"] = clock.left("sequence")
    done = part["block_kernel"] and (count < 2 or len(part["decode"]) == 2)
    part["status"] = "ok" if done and not part["errors"] else "partial" if part["block_kernel"] else "failed"


def time_block_kernel(plan: Plan, kernel: str) -> dict:
    """Queries of a rank's chunk pair over a passing block from a rank with earlier chunks (every key visible):
    ms per call and TFLOP/s (4 x N x M x heads x dim)."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxinfer.pallas_kernels.block_attention import block_attention, block_attention_reference

    n, heads, kv, d = plan.block
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (n, heads, d), plan.dtype)
    k, v = (jax.random.normal(x, (n, kv, d), plan.dtype) for x in keys[1:])
    seq, pos = jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32)
    fn = (functools.partial(block_attention, interpret=plan.platform == "cpu") if kernel == "pallas"
          else block_attention_reference)
    f = jax.jit(functools.partial(fn, sm_scale=d ** -0.5))
    args = (q, pos + n, seq, k, v, pos, seq)
    jax.block_until_ready(f(*args))                     # compiles
    runs, t0 = 3, time.perf_counter()
    for _ in range(runs):
        out = f(*args)
    jax.block_until_ready(out)
    seconds = (time.perf_counter() - t0) / runs
    return {"kernel": kernel, "tokens": n, "heads": heads, "kv_heads": kv, "head_dim": d, "ms": 1e3 * seconds,
            "tflops": 4 * n * n * heads * d / seconds / 1e12}


def sp_prefill_and_decode(plan: Plan, sp: int, part: dict) -> None:
    """One prompt of plan.sp_prompt_len tokens in one step, then 16 tokens decoded after it, at sp."""
    import numpy as np

    from jaxinfer.bench.sequence import generate_once
    from jaxinfer.llm import LLM

    n = plan.sp_prompt_len
    llm = LLM.random(plan.model, mesh=f"sp={sp}", dtype=plan.dtype, seed=0, max_tokens_per_step=n, max_num_seqs=1,
                     prefix_caching=False, compilation_cache=False)
    try:
        rng = np.random.default_rng(sp)
        prompt = lambda: rng.integers(4, llm.config.vocab_size, n).tolist()  # noqa: E731
        for tokens, phase in ((1, "prefill"), (17, "decode")):
            generate_once(llm, prompt(), tokens)                              # compiles
            s = generate_once(llm, prompt(), tokens)
            if phase == "prefill":
                part["prefill"].append({"sp": sp, "prompt_len": n, "seconds": s.prefill_seconds,
                                        "tokens_per_second": n / s.prefill_seconds})
            else:
                part["decode"].append({"sp": sp, "context": n,
                                       "ms_per_token": 1e3 * s.decode_seconds / s.decode_tokens})
    finally:
        llm.close()


# ---- markdown -------------------------------------------------------------------------------------------------
def markdown(r: dict) -> str:
    env, dev = r["environment"], r.get("device") or {}
    lines = ["# jaxinfer GPU check" + (" (dry run on CPU)" if r["dry_run"] else ""), "",
             f"Started {r['started']}; {'finished' if r['finished'] else 'NOT finished'} after "
             f"{r['wall_seconds']:.0f} s. Device: {dev.get('device_kind', '?')} x {dev.get('device_count', '?')} "
             f"({dev.get('platform', '?')}). Python {env['python']}, jax {env['jax']}, jaxlib {env['jaxlib']}"
             + "".join(f", {k} {v}" for k, v in env["jax_cuda_plugin"].items()) + ".", ""]
    lines += (kernel_lines(r["kernel_tests"]) + decode_lines(r["decode"]) + serving_lines(r["serving"])
              + calibration_lines(r["calibration"]) + sequence_lines(r["sequence"]))
    if r["notes"]:
        lines += ["## Notes", "", *(f"- {n}" for n in r["notes"]), ""]
    if r["warnings"]:
        lines += ["## Warnings", "", *(f"- {w['category']} x{w['count']}: {w['message']}" for w in r["warnings"]), ""]
    return "\n".join(lines)


def calibration_lines(c: dict) -> list[str]:
    lines = ["## Calibration (the layout planner's figures)", "", *status_line(c)]
    if "measured" not in c:
        return lines + [f"- {e}" for e in c.get("errors", [])]
    got, assumed = c["measured"], c.get("assumed")
    rows = [("memory bandwidth, GB/s", got["memory_bandwidth"] / 1e9,
             assumed and assumed["memory_bandwidth"] / 1e9),
            *((f"{d} matmul, TFLOP/s", got["matmul_flops"][d] / 1e12, assumed and assumed["matmul_flops"][d] / 1e12)
              for d in got["matmul_flops"]),
            ("host work per step, ms", got["step_overhead"] * 1e3, assumed and assumed["step_overhead"] * 1e3)]
    lines += [f"Planner's kind: {c.get('kind', 'none for this device')}" + (f" ({c['source']})" if c.get("source")
                                                                           else ""), "",
              "| figure | measured | assumed | measured / assumed |", "| --- | --- | --- | --- |"]
    for name, value, want in rows:
        ratio = f"{value / want:.2f}" if want else "-"
        lines.append(f"| {name} | {value:.3g} | {f'{want:.3g}' if want else '-'} | {ratio} |")
    return lines + [""]


def sequence_lines(q: dict) -> list[str]:
    lines = ["## Sequence parallel", "", *status_line(q)]
    if q.get("block_kernel"):
        lines += ["The ring's block kernel: a chunk pair's queries over a passing block, every key visible.", "",
                  "| kernel | tokens | heads / kv heads / dim | ms | TFLOP/s |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {b['kernel']} | {b['tokens']} | {b['heads']} / {b['kv_heads']} / {b['head_dim']} | "
                  f"{b['ms']:.3f} | {b['tflops']:.3g} |" for b in q["block_kernel"]] + [""]
    if q.get("prefill") or q.get("decode"):
        lines += ["| sp | prefill s | prefill tok/s | decode ms/token |", "| --- | --- | --- | --- |"]
        lines += [f"| {p['sp']} | {p['seconds']:.3f} | {p['tokens_per_second']:,.0f} | "
                  + next((f"{d['ms_per_token']:.2f}" for d in q["decode"] if d["sp"] == p["sp"]), "-") + " |"
                  for p in q["prefill"]] + [""]
    if q.get("multi_device"):
        lines += [f"Prefill and decode across devices: {q['multi_device']}.", ""]
    return lines + [f"- ERROR {e['what']}: {e['error'][:300]}" for e in q.get("errors", [])] + [""]


def _float(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def gbps(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def status_line(part: dict) -> list[str]:
    text = f"Status: **{part['status']}**" + (f" ({part['reason']})" if part.get("reason") else "")
    return [text, ""]


def kernel_lines(k: dict) -> list[str]:
    mode = "interpret mode" if k.get("interpret_mode") else "compiled through Triton"
    lines = [f"## Kernel tests ({mode})", "", *status_line(k)]
    if "total" in k:
        lines += ["| passed | failed | errors | skipped | seconds |", "| --- | --- | --- | --- | --- |",
                  f"| {k['passed']} | {k['failed']} | {k['errors']} | {k['skipped']} | {k['seconds']:.1f} |", ""]
        lines += [f"- FAILED {f['test']}: {f['message']}" for f in k["failures"]]
        lines += [f"- skipped {f['test']}: {f['message']}" for f in k.get("skips", [])]
        lines += [f"`{k['command']}`", ""]
    return lines


def decode_lines(d: dict) -> list[str]:
    lines = ["## Decode", "", *status_line(d)]
    if "model" not in d:
        return lines
    n = d["num_params"]
    size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
    lines += [f"{d['model']} ({size} parameters), random {d['dtype']} weights made on the device; prompt "
              f"{d['prompt_len']} token(s), {d['max_tokens']} new, greedy.", ""]
    bw = d.get("bandwidth")
    if bw:
        spec = f"; datasheet {bw['spec_gbps']:,.0f} GB/s" if bw.get("spec_gbps") else ""
        lines += [f"Bandwidth ({bw['device_kind']}, {bw['buffer_mib']} MiB buffer): copy {gbps(bw['copy_gbps'])} GB/s "
                  f"(read + write), sum {gbps(bw['read_gbps'])} GB/s (read); MBU divides by {gbps(bw['gbps'])} GB/s"
                  f"{spec}.", ""]
    if d.get("matmuls"):
        lines += ["One weight's matmul alone, in each form:", "",
                  "| form | K x N | rows | us | weight GB/s | weight-sized transposes / copies |", "| --- " * 6 + "|"]
        lines += [f"| {m['form']} | {m['k']} x {m['n']} | {m['rows']} | {m['us']:.1f} | {gbps(m['gbps'])} | "
                  f"{m['weight_copies']} |" for m in d["matmuls"]] + [""]
    if d["results"]:
        lines += ["| backend | batch | decode tok/s | ms/step | MBU | GB/s read | W + K GB/step | prefill tok/s | "
                  "compile s | host ms/step | device idle | XLA floor tok/s | of floor |", "| --- " * 13 + "|"]
        lines += [f"| {x['backend']} | {x['batch']} | {x['decode_tokens_per_second']:,.1f} | "
                  f"{x['decode_ms_per_token']:.2f} | {x['mbu']:.1%} | {gbps(x['decode_bandwidth_gbps'])} | "
                  f"{(x['weight_bytes_per_step'] + x['kv_bytes_per_step']) / 1e9:.2f} | "
                  f"{x['prefill_tokens_per_second']:,.0f} | {x['compile_seconds']:.1f} | {x['host_ms_per_step']:.2f} | "
                  f"{x['device_idle']:.1%} | {_float(x['xla_floor_tokens_per_second'], ',.1f')} | "
                  f"{_float(x['of_floor'], '.1%')} |" for x in d["results"]]
        lines.append("")
    for x in d["results"]:
        if x.get("ops"):
            p = x["ops"]
            graphs = " without CUDA graphs" if p.get("xla_options") == NO_CUDA_GRAPHS else ""
            lines += [f"Costliest device operations, {x['backend']} batch {x['batch']}{graphs} ({p['steps']} steps "
                      f"traced into `{Path(p['trace']).name}`):", "",
                      "| ms/step | runs/step | share | operation (program) | source |", "| --- " * 5 + "|"]
            lines += [f"| {o['ms_per_step']:.3f} | {o['runs_per_step']:.1f} | {o['share']:.1%} | {o['name']} "
                      f"({o['module']}) | `{o['source']}` |" for o in p["ops"]]
            lines.append("")
    lines += [f"- {x['backend']} batch {x['batch']}: {x['one_byte_copies']['count']} transposes or copies of 1-byte "
              f"arrays in the decode step, {x['one_byte_copies']['bytes'] / 2**20:.1f} MiB written"
              for x in d["results"] if "one_byte_copies" in x]
    lines += [f"- skipped {s['backend']} batch {s['batch']}: {s['reason']}" for s in d["skipped"]]
    lines += [f"- ERROR {e['what']}: {e['error'][:300]}" for e in d["errors"]]
    a = d.get("agreement")
    if a and a.get("status") == "ok":
        lines.append(f"- {' vs '.join(a['backends'])}, same {a['sequences']} greedy prompts (batch {a['batch']}): "
                     f"{a['identical']} identical over {a['tokens_per_sequence']} tokens, {a['first_token_equal']} "
                     f"with the same first token, mean common prefix {a['mean_common_prefix']:.1f} tokens")
    elif a:
        lines.append(f"- backend agreement skipped: {a['reason']}")
    return [*lines, ""]


def serving_lines(s: dict) -> list[str]:
    lines = ["## Serving (bench_serving, in-process streams)", "", *status_line(s)]
    if "duration_s" in s:
        lines += [f"{s['model']}, {s['attention_backend']} attention; `{s['flags']}`", "",
                  "| requests | duration s | output tok/s | total tok/s | TTFT median / p99 ms | TPOT median / p99 ms "
                  "| ITL median ms | steps | compilations (measured) | preemptions | warm-up s |", "| --- " * 11 + "|",
                  f"| {s['completed']}/{s['num_requests']} | {s['duration_s']:.2f} | {s['output_throughput']:,.1f} | "
                  f"{s['total_token_throughput']:,.1f} | {s['ttft']['median_ms']:,.1f} / {s['ttft']['p99_ms']:,.1f} | "
                  f"{s['tpot']['median_ms']:.2f} / {s['tpot']['p99_ms']:.2f} | {s['itl']['median_ms']:.2f} | "
                  f"{s['steps']} | {s['compilations_total']} ({s['compilations_measured']}) | {s['preemptions']} | "
                  f"{s['warmup_s']:.1f} |", ""]
    lines += [f"- ERROR {e['what']}: {e['error'][:300]}" for e in s.get("errors", [])]
    return [*lines, ""]


# ---- the run ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("outdir", nargs="?", default=os.environ.get("OUT"),
                   help="where gpu_check.json and gpu_check.md go (default: $OUT)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, every part end to end")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's time budget")
    args = p.parse_args(argv)
    if not args.outdir:
        p.error("give an output directory (or set $OUT)")
    if not (args.budget_scale > 0 and math.isfinite(args.budget_scale)):
        p.error("--budget-scale must be a positive number")
    return args


def record_warnings(caught: list[warnings.WarningMessage], report: Report) -> None:
    counts: dict[tuple[str, str], int] = {}
    for w in caught:
        key = (w.category.__name__, str(w.message)[:400])
        counts[key] = counts.get(key, 0) + 1
    report.data["warnings"] = [{"category": c, "message": m, "count": n} for (c, m), n in counts.items()]


def run(args: argparse.Namespace) -> int:
    plan = DRY_RUN if args.dry_run else GPU
    if args.dry_run:                               # before this process starts a JAX backend
        import jax

        jax.config.update("jax_platforms", "cpu")
        # its figures mean nothing, so compile without optimisation passes (as the test suite does)
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    report = Report(Path(args.outdir), plan)
    clock = Clock(plan.budgets, args.budget_scale)
    report.data["budgets_s"] = dict(clock.budgets)
    missing = [p for p in HTTP_PACKAGES if not report.data["environment"]["packages"][p]]
    report.note("The serving part drives the engine in-process (bench_serving without --http); the HTTP layer is "
                "not measured" + (f" (and could not be here: {', '.join(missing)} not importable)." if missing
                                  else "."))

    def stop(signum, frame):
        raise TimeUp()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
    try:
        report.save()
        report.data["kernel_tests"] = kernel_tests(plan, clock.left("kernel_tests"))
        report.save()
        import jax

        report.data["device"] = devices()
        if not args.dry_run and jax.default_backend() != "gpu":
            report.note(f"no GPU: JAX's default backend is {jax.default_backend()!r}; the decode and serving parts "
                        "need one (use --dry-run on CPU)")
            report.data["decode"] = report.data["serving"] = report.data["calibration"] = {
                "status": "skipped", "reason": "no GPU"}
            report.data["sequence"] = {"status": "skipped", "reason": "no GPU"}
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("default")
                try:
                    decode(plan, clock, report)
                except Exception as e:   # outside any one item: the bandwidth, say
                    report.data["decode"].update(status="failed", error=f"{type(e).__name__}: {e}"[:1000],
                                                 traceback_tail=traceback.format_exc()[-2000:])
                record_warnings(caught, report)
                report.save()
                serving(plan, clock, report)
                record_warnings(caught, report)
                report.save()
                calibration(plan, clock, report)
                record_warnings(caught, report)
                report.save()
                sequence(plan, clock, report)
                record_warnings(caught, report)
        report.data["finished"] = True
    except TimeUp:
        report.note(f"stopped by SIGTERM after {clock.elapsed():.0f} s: the parts after that point did not run")
        report.save()
        return 124
    finally:
        report.save()
    ok = all(report.data[p]["status"] == "ok" for p in ("kernel_tests", "decode", "serving", "calibration", "sequence"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = run(args)
    print(f"{Path(args.outdir) / 'gpu_check.md'} (exit status {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
