"""A two-process job (launch/local.sh) gives the tokens a single process gives, on the same mesh."""

import json
import os
import subprocess
import sys
from pathlib import Path

from jaxinfer import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]


def test_two_processes_equal_one(tmp_path, hf_tiny):
    llama = hf_tiny / "llama"
    flags = ["--mesh", "dp=2,tp=2", "--model", str(llama), "--prompt", "Distributed inference", "--max-tokens", "6",
             "--dtype", "float32", "--json"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHON=sys.executable, JAX_PLATFORMS="cpu", JAXINFER_LOG_DIR=str(tmp_path))
    r = subprocess.run(["bash", str(REPO / "launch" / "local.sh"), "2", *flags], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4 and result["mesh"]["dp"] == 2 and result["mesh"]["tp"] == 2

    llm = LLM(llama, mesh="dp=2,tp=2", dtype="float32")
    alone = llm.generate(["Distributed inference"], SamplingParams(max_tokens=6, temperature=0, seed=0))[0]
    assert result["output_token_ids"] == alone.token_ids
    assert result["output_text"] == alone.text
    assert result["collectives"]["decode"] == llm.collective_report()["decode"]
