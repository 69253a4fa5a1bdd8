"""A two-process job (launch/local.sh) gives the tokens a single process gives, on the same mesh: one dp
replica per process, or one pipeline stage per process (the activations cross processes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxinfer import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "pp=2,tp=2"])
def test_two_processes_equal_one(tmp_path, hf_tiny, mesh):
    llama = hf_tiny / "llama"
    flags = ["--mesh", mesh, "--model", str(llama), "--prompt", "Distributed inference", "--max-tokens", "6",
             "--dtype", "float32", "--json"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHON=sys.executable, JAX_PLATFORMS="cpu", JAXINFER_LOG_DIR=str(tmp_path))
    r = subprocess.run(["bash", str(REPO / "launch" / "local.sh"), "2", *flags], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    sizes = dict(axis.split("=") for axis in mesh.split(","))
    assert result["devices"] == 4 and all(result["mesh"][a] == int(n) for a, n in sizes.items())

    llm = LLM(llama, mesh=mesh, dtype="float32")
    alone = llm.generate(["Distributed inference"], SamplingParams(max_tokens=6, temperature=0, seed=0))[0]
    assert result["output_token_ids"] == alone.token_ids
    assert result["output_text"] == alone.text
    assert result["collectives"]["decode"] == llm.collective_report()["decode"]
