"""`python -m jaxinfer.launch` end to end, in a subprocess that sets up its own fake CPU devices."""

import json
import os
import subprocess
import sys

import pytest

from jaxinfer.random_model import DEFAULT

LAYERS = DEFAULT["num_hidden_layers"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One JAXINFER_CACHE for the module, so the random default model is written once."""
    return tmp_path_factory.mktemp("jaxinfer-cache")


def launch(cache, *args, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAXINFER_CACHE"] = str(cache)
    env["JAX_PLATFORMS"] = "cpu"   # the launcher's fake-device path; an accelerator host would use its own devices
    return subprocess.run([sys.executable, "-m", "jaxinfer.launch", *args], cwd=cache, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tp2_run(cache):
    r = launch(cache, "--mesh", "tp=2", "--max-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def tp2(tp2_run):
    return json.loads(tp2_run.stdout)


def test_json_is_the_only_stdout(tp2_run):
    out = tp2_run.stdout.strip()
    assert out.startswith("{") and out.endswith("}") and "\n" not in out    # one object on one line
    assert isinstance(json.loads(out), dict)


def test_mesh_and_model(cache, tp2):
    assert tp2["mesh"] == {"dp": 1, "pp": 1, "tp": 2, "ep": 1, "sp": 1}
    assert tp2["devices"] == 2
    assert tp2["platform"] == "cpu"
    assert tp2["random_weights"] is True
    assert "random weights" in tp2["model"]
    assert tp2["model"].startswith(str(cache))
    assert (cache / "default-random-llama" / "model.safetensors").is_file()
    assert tp2["architecture"] == "LlamaForCausalLM"
    assert tp2["dtype"] == "float32"


def test_output(tp2):
    assert len(tp2["output_token_ids"]) == 4
    assert all(0 <= t < DEFAULT["vocab_size"] for t in tp2["output_token_ids"])
    assert tp2["finish_reason"] in ("length", "stop")
    assert tp2["prompt_tokens"] > 0
    assert tp2["compile_seconds"] > 0


def test_parameter_bytes_are_split(tp2):
    c = DEFAULT
    E, M, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    D = E // c["num_attention_heads"]
    H, KV = c["num_attention_heads"], c["num_key_value_heads"]
    sharded = 2 * V * E + L * (E * H * D * 2 + 2 * E * KV * D + 3 * E * M)   # split over tp
    replicated = E + 2 * L * E                                                # norms
    assert tp2["parameter_bytes_per_device"] == 4 * (sharded // 2 + replicated)


def test_collectives(tp2):
    decode = tp2["collectives"]["decode"]
    assert decode["all-reduce"]["count"] == 2 * LAYERS + 1     # attention and MLP per layer, and the embedding
    assert decode["all-gather"]["count"] == 1                  # the vocabulary-parallel logits
    assert decode["all-reduce"]["bytes"] == (2 * LAYERS + 1) * DEFAULT["hidden_size"] * 4   # batch 1, float32
    assert decode["all-gather"]["bytes"] == DEFAULT["vocab_size"] * 4
    for kind in ("reduce-scatter", "all-to-all", "collective-permute"):
        assert decode[kind]["count"] == 0
    assert tp2["collectives"]["prefill"]["all-reduce"]["count"] == 2 * LAYERS + 1


def test_readable_output(cache):
    r = launch(cache, "--mesh", "tp=2", "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert "random weights" in r.stdout
    assert "tp=2 on 2 cpu device(s)" in r.stdout
    assert "3 tokens" in r.stdout
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.stdout)


def test_unknown_axis_exits_2(cache):
    r = launch(cache, "--mesh", "xp=2", "--json")
    assert r.returncode == 2
    assert "xp" in r.stderr and "dp, pp, tp, ep, sp" in r.stderr
    assert r.stdout == ""


def test_tp_not_dividing_heads_exits_2(cache):
    r = launch(cache, "--mesh", "tp=3", "--json")
    assert r.returncode == 2
    assert "tp=3" in r.stderr and f"{DEFAULT['num_attention_heads']} attention heads" in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_missing_model_exits_2(cache):
    r = launch(cache, "--mesh", "tp=2", "--model", str(cache / "no-such-model"))
    assert r.returncode == 2
    assert "no-such-model" in r.stderr and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr
