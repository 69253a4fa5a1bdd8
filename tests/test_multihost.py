"""A two-process job (launch/local.sh) gives the tokens a single process gives, on the same mesh: one dp
replica per process, or one pipeline stage per process (the activations cross processes)."""

import json

import numpy as np

from jaxinfer import SamplingParams


def test_two_processes_equal_one(tmp_path, hf_tiny, two_processes, tiny_llm):
    """One pipeline stage per process (dp=2,tp=2 across processes: the batch file below)."""
    llama, mesh = hf_tiny / "llama", "pp=2,tp=2"
    flags = ["--mesh", mesh, "--model", str(llama), "--prompt", "Distributed inference", "--max-tokens", "6",
             "--dtype", "float32", "--json"]
    result = two_processes(flags, tmp_path)
    sizes = dict(axis.split("=") for axis in mesh.split(","))
    assert result["devices"] == 4 and all(result["mesh"][a] == int(n) for a, n in sizes.items())

    llm = tiny_llm(mesh=mesh)
    alone = llm.generate(["Distributed inference"], SamplingParams(max_tokens=6, temperature=0, seed=0))[0]
    assert result["output_token_ids"] == alone.token_ids
    assert result["output_text"] == alone.text
    assert result["collectives"]["decode"] == llm.collective_report()["decode"]


def test_a_batch_file_on_two_processes_equals_one(tmp_path, hf_tiny, two_processes, tiny_llm):
    """Process 0 reads the file and broadcasts each turn's requests; the other process follows its loop."""
    from jaxinfer.serve.batch_job import run_batch_file

    llama, mesh = hf_tiny / "llama", "dp=2,tp=2"
    rng = np.random.default_rng(1)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": rng.integers(4, 384, size=int(n)).tolist(), "max_tokens": int(m),
                       "temperature": 0.8, "seed": i, "ignore_eos": True}}
             for i, (n, m) in enumerate(zip(rng.integers(1, 60, size=6), rng.integers(1, 12, size=6), strict=True))]
    src = tmp_path / "requests.jsonl"
    src.write_text("\n".join(map(json.dumps, lines)) + "\n{bad line\n")
    flags = ["--mesh", mesh, "--model", str(llama), "--dtype", "float32", "--input", str(src),
             "--output", str(tmp_path / "two.jsonl"), "--json"]
    assert two_processes(flags, tmp_path) == {"requests": 7, "succeeded": 6, "failed": 1}

    run_batch_file(tiny_llm(mesh=mesh), str(llama), src, tmp_path / "one.jsonl")

    def texts(name: str) -> list:
        rows = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        return [(x["custom_id"], x["response"] and x["response"]["body"]["choices"][0]["text"]) for x in rows]

    assert texts("two.jsonl") == texts("one.jsonl")
    assert len(texts("one.jsonl")) == 7 and all(t for _, t in texts("one.jsonl")[:6])
