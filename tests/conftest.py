"""Eight fake CPU devices, set before JAX starts; the CPU backend compiles without optimisation passes, which
cuts the suite's compile time by about a fifth (tiny shapes: the programs run in microseconds either way).
JAX_PLATFORMS=cuda runs the tests on a GPU instead (scripts/gpu_check.sh does so for the kernel tests)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           + (" --xla_backend_optimization_level=0" if os.environ["JAX_PLATFORMS"] == "cpu" else "")
                           ).strip()
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")  # tests compile afresh; test_warmup checks the cache

# ---- the Hugging Face reference fixtures (../shared/fixtures/hf-tiny) ------------------------------------
# Everything below runs after the environment above is set; nothing here imports JAX.
import json  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
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


@pytest.fixture
def float32_dots_exact():
    """float32 matmuls in full precision: a GPU's default is TF32 (XLA and the Triton lowering alike), which
    the float32 tolerances of the kernel tests are not meant for. On CPU float32 dots are exact either way."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield
