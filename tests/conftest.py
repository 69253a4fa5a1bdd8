"""Eight fake CPU devices, set before JAX starts; the CPU backend compiles at LLVM -O0, the engine's steps too
(a level in XLA_FLAGS overrides the engine's -O2), which cuts the suite's compile time by about a third (tiny
shapes: the programs run in microseconds either way). GPU programs compiled here for a GPU that is not
(jaxinfer.device.gpu_target) take XLA's default kernel configurations rather than compiling candidates until one
compiles (autotuning needs the GPU): the same operands and writes, in about 40% less time.
JAX_PLATFORMS=cuda runs the tests on a GPU instead (scripts/gpu_check.sh does so for the kernel tests).

One compilation cache for the run (JAX's and the engine's step executables, jaxinfer.device.compilation_cache):
the controller makes a fresh directory before the xdist workers start, so they and every child process inherit
it, and removes it when the run ends. Modules that build the same model on the same mesh, in either worker,
compile each program once. A fresh directory per run keeps every run's first compilation honest;
JAX_ENABLE_COMPILATION_CACHE=false runs without it, JAX_COMPILATION_CACHE_DIR picks the directory."""
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           + (" --xla_backend_optimization_level=0 --xla_gpu_autotune_level=0"
                              if os.environ["JAX_PLATFORMS"] == "cpu" else "")
                           ).strip()
RUN_CACHE = None      # the directory this process made, and removes at the end of the run
if (os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "true") != "false"
        and "JAX_COMPILATION_CACHE_DIR" not in os.environ):   # set by the controller for its workers
    RUN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxinfer-test-xla-")


def pytest_sessionfinish(session, exitstatus) -> None:
    if RUN_CACHE is not None:
        shutil.rmtree(RUN_CACHE, ignore_errors=True)

# ---- the Hugging Face reference fixtures (../shared/fixtures/hf-tiny) ------------------------------------
# Everything below runs after the environment above is set; nothing here imports JAX.
import json  # noqa: E402
from collections.abc import Callable, Mapping  # noqa: E402
from pathlib import Path  # noqa: E402
from types import MappingProxyType  # noqa: E402
from typing import NamedTuple  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

HF_TINY = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf-tiny"


class Golden(NamedTuple):
    """One fixture's reference outputs from transformers (golden.npz, golden.json)."""

    prompts: list[list[int]]   # token ids of each prompt, BOS included, without padding
    logits: np.ndarray         # float32 [prompts, longest prompt, vocab]: row i is valid up to len(prompts[i])
    greedy: list[list[int]]    # the greedy continuation of each prompt (golden.json's new_tokens of them)
    texts: list[str]           # the prompts as text (golden.json)


def load_golden(name: str) -> Golden:
    """A fresh copy each call: tests may not change what other tests read."""
    g = np.load(HF_TINY / name / "golden.npz")
    prompts = [[int(t) for t in g["input_ids"][i, :n]] for i, n in enumerate(g["lengths"])]
    texts = json.loads((HF_TINY / name / "golden.json").read_text())["prompts"]
    return Golden(prompts, g["logits"], [[int(t) for t in row] for row in g["greedy"]], texts)


@pytest.fixture(scope="session")
def hf_tiny() -> Path:
    """The hf-tiny fixtures directory (read-only): one sub-directory per checkpoint, e.g. hf_tiny / "llama".
    Where it is absent, tests that need it fail, unless JAXINFER_FIXTURES_OPTIONAL is set (the GPU check
    sets it: a GPU machine gets this checkout without ../shared), which skips them instead."""
    if not HF_TINY.is_dir() and os.environ.get("JAXINFER_FIXTURES_OPTIONAL"):
        pytest.skip(f"{HF_TINY} is not here (JAXINFER_FIXTURES_OPTIONAL is set)")
    return HF_TINY


@pytest.fixture(scope="session")
def golden() -> Callable[[str], Golden]:
    """golden(name) -> Golden: the reference prompts, logits and greedy tokens of hf_tiny / name."""
    return load_golden


def greedy_path_matches(llm, prompt: list[int], path: list[int], reference_path: list[int], tol: float = 1e-4) -> None:
    """Token by token: where our greedy path first differs from the reference's, the reference's logits (ours,
    along our path) must be near-tied."""
    if path == reference_path:
        return
    ours = llm.logits([prompt + path[:-1]])[0][len(prompt) - 1:]
    for t, (a, b) in enumerate(zip(path, reference_path, strict=True)):
        if a != b:
            assert abs(ours[t, a] - ours[t, b]) <= tol, f"step {t}: {a} vs reference {b} not a near-tie"
            return


@pytest.fixture(scope="session")
def check_greedy_path() -> Callable[..., None]:
    """check_greedy_path(llm, prompt, path, reference_path): our greedy tokens against a fixture's, near-ties
    allowed (test_fixtures.py, test_fixtures_moe.py)."""
    return greedy_path_matches


def reference_matches(llm, golden: Golden, tol: float = 1e-4) -> int:
    """A fixture's reference on `llm`: the logits of its prompts within tol, nothing counted as expert load by
    scoring, and greedy generation of as many tokens as the reference's along its path (greedy_path_matches).
    Returns that number of new tokens."""
    from jaxinfer import SamplingParams

    prompts, ref_logits, ref_greedy, _ = golden
    for i, logits in enumerate(llm.logits(prompts)):
        np.testing.assert_allclose(logits, ref_logits[i, : len(prompts[i])], atol=tol, rtol=0)
    assert llm.engine.expert_load.total is None                 # scoring routes tokens but does not count them
    new_tokens = len(ref_greedy[0])
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    for prompt, out, ref in zip(prompts, outs, ref_greedy, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == len(ref) == new_tokens
        greedy_path_matches(llm, prompt, out.token_ids, ref, tol)
    return new_tokens


@pytest.fixture(scope="session")
def check_reference() -> Callable[..., int]:
    """check_reference(llm, golden): reference_matches (test_fixtures.py, test_fixtures_moe.py)."""
    return reference_matches


@pytest.fixture
def float32_dots_exact():
    """float32 matmuls in full precision: a GPU's default is TF32 (XLA and the Triton lowering alike), which
    the float32 tolerances of the kernel tests are not meant for. On CPU float32 dots are exact either way."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield


# ---- models and caches shared by the modules of one worker process -----------------------------------------
# With `pytest -n 2 --dist loadfile` each worker is its own process with its own session: what is cached here is
# built at most once per worker, by the first module that asks for it.


@pytest.fixture(scope="session")
def tiny_llm(hf_tiny):
    """tiny_llm(name="llama", mesh="", **engine_args) -> the hf-tiny checkpoint `name` in float32 on `mesh`, one
    LLM per distinct set of arguments for the whole session, so modules asking for the same model and step budget
    (EngineConfig fields: max_tokens_per_step, num_pages, ...) share it and its compiled steps.

    Only for tests that leave it as they found it: no request running, the loop alive, methods they patched
    restored (each hand-out checks the first two). Every hand-out empties its prefix cache, so a module's first
    requests find no pages cached by another module. A test that needs a fresh engine (counters from zero, a
    closed or collected LLM) builds its own."""
    from jaxinfer import LLM

    built: dict[tuple, LLM] = {}

    def get(name: str = "llama", mesh: str = "", **engine_args) -> LLM:
        key = (name, mesh, tuple(sorted(engine_args.items())))
        if key not in built:
            built[key] = LLM(hf_tiny / name, mesh=mesh, dtype="float32", **engine_args)
        llm = built[key]
        _wait_idle(llm)
        llm.engine.reset_prefix_cache()
        return llm

    yield get
    for llm in built.values():
        llm.close()


def _wait_idle(llm, timeout: float = 30.0) -> None:
    """A shared LLM is handed out idle: aborts a module sent just before it ended are applied between steps."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        with llm.loop.lock:
            idle = llm.loop.running == 0 and not llm.engine.has_unfinished()
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle and llm.loop.dead is None, (
        f"the shared LLM ({llm.source}, {llm.mesh_config}) was left busy or dead by the module before: "
        f"{llm.loop.running} running, dead={llm.loop.dead!r}")


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """random_checkpoint(config, seed=0) -> a checkpoint directory of jaxinfer.random_model.write_random_checkpoint
    (config.json, safetensors, a byte-level tokenizer for a vocabulary of 264 or more), written once per session
    for each distinct config and seed. Read-only: a test that changes a checkpoint writes its own."""
    from jaxinfer.random_model import write_random_checkpoint

    written: dict[tuple[str, int], Path] = {}

    def get(config: dict, seed: int = 0) -> Path:
        key = (json.dumps(config, sort_keys=True), seed)
        if key not in written:
            written[key] = write_random_checkpoint(tmp_path_factory.mktemp("random-checkpoint") / "model", config,
                                                   seed)
        return written[key]

    return get


@pytest.fixture(scope="session")
def cpu_kernel() -> Path | None:
    """The C++ CPU attention kernel (jaxinfer/device/attention/cpu.py) as this process builds it on first use,
    in its own cache directory, as the in-process tests do; None where it cannot be built."""
    from jaxinfer.device.attention import cpu

    try:
        return cpu.build()
    except cpu.BuildError:
        return None                         # the children fall back to the jnp reference too


@pytest.fixture(scope="session")
def put_cpu_kernel(cpu_kernel) -> Callable[[Path], None]:
    """put_cpu_kernel(cache): the C++ kernels (attention, quantized matmul) copied (atomically) to cache/kernels
    under their names, where a child process whose JAXINFER_CACHE is `cache` looks for them before building
    them: what a machine with a warm cache does (the build itself is tested in test_ragged_paged_attention)."""
    import shutil

    from jaxinfer.device import native, quant_matmul_cpu

    def put(cache: Path) -> None:
        if cpu_kernel is None:
            return
        for built in (cpu_kernel, native.build(quant_matmul_cpu.SOURCE)):
            target = Path(cache) / "kernels" / built.name
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(f"{built.name}.{os.getpid()}.partial")
                shutil.copyfile(built, partial)
                os.replace(partial, target)

    return put


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory, put_cpu_kernel) -> Path:
    """One $JAXINFER_CACHE for the child processes of the whole run, both xdist workers: the random default model
    is written there once (jaxinfer.random_model.ensure: processes racing to write it are harmless) and the CPU
    attention kernel is put there (put_cpu_kernel). The children share the run's compilation cache too (above);
    test_warmup, which tests that cache, gives its children a directory of their own."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                  # the run's base directory, which holds the workers' own
    cache = root / "jaxinfer-cache"
    cache.mkdir(exist_ok=True)
    put_cpu_kernel(cache)
    return cache


def devices_of_its_own(env: Mapping[str, str]) -> dict[str, str]:
    """env for a child that asks XLA for its own number of CPU devices (the launcher, the server, a process of a
    two-process job): XLA_FLAGS without the eight fake devices, the rest of it (LLVM at -O0) kept."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    return {**env, "XLA_FLAGS": " ".join(flags)}


@pytest.fixture(scope="session")
def subprocess_env(shared_cache) -> Mapping[str, str]:
    """The environment for a jaxinfer child process (read-only: copy it to change it): this one's, with the run's
    shared JAXINFER_CACHE. It keeps XLA_FLAGS (the eight fake devices): a child that sets up its own takes
    devices_of_its_own(subprocess_env)."""
    return MappingProxyType({**os.environ, "JAXINFER_CACHE": str(shared_cache)})


@pytest.fixture(scope="session")
def two_processes(subprocess_env) -> Callable[..., dict]:
    """two_processes(flags, cwd) -> the last JSON line of a two-process job (launch/local.sh 2 FLAGS...) run in
    `cwd` (its logs go there too), after checking that it exited 0."""
    import subprocess
    import sys

    def run(flags: list[str], cwd: Path) -> dict:
        env = devices_of_its_own(subprocess_env)
        env.update(PYTHON=sys.executable, JAX_PLATFORMS="cpu", JAXINFER_LOG_DIR=str(cwd))
        r = subprocess.run(["bash", str(Path(__file__).resolve().parents[1] / "launch" / "local.sh"), "2", *flags],
                           env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    return run
