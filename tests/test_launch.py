"""`python -m jaxinfer.launch` end to end, in a subprocess that sets up its own fake CPU devices."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import devices_of_its_own

from jaxinfer.random_model import DEFAULT
from jaxinfer.tokenizer import Tokenizer

LAYERS = DEFAULT["num_hidden_layers"]


@pytest.fixture(scope="module")
def cache(shared_cache):
    """The run's JAXINFER_CACHE (tests/conftest.py): the random default model is written once, the CPU attention
    kernel is already there."""
    return shared_cache


def launch(cache, *args, timeout=300) -> subprocess.CompletedProcess:
    env = devices_of_its_own(os.environ)
    env["JAXINFER_CACHE"] = str(cache)
    env["JAX_PLATFORMS"] = "cpu"   # the launcher's fake-device path; an accelerator host would use its own devices
    return subprocess.run([sys.executable, "-m", "jaxinfer.launch", *args], cwd=cache, env=env,
                          capture_output=True, text=True, timeout=timeout)


TP2 = ("--mesh", "tp=2", "--max-tokens", "4")
DEFAULT_PROMPT = "The capital of France is"   # what the launcher serves without --prompt or --chat


@pytest.fixture(scope="module")
def tp2_run(cache):
    r = launch(cache, *TP2, "--json")
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
    assert tp2["kv_cache_dtype"] == "float32"                  # "auto": the model's dtype
    c = DEFAULT   # per device: layers x its 2 of the 4 KV heads x (K, V) x head_dim float32 values
    assert tp2["kv_bytes_per_token_per_device"] == LAYERS * 2 * 2 * c["hidden_size"] // c["num_attention_heads"] * 4


def test_output(cache, tp2):
    ids = tp2["output_token_ids"]
    assert len(ids) == 4
    assert all(0 <= t < DEFAULT["vocab_size"] for t in ids)
    # four tokens: the budget ran out, unless the fourth is the end of sequence
    assert tp2["finish_reason"] == ("stop" if ids[-1] == DEFAULT["eos_token_id"] else "length")
    tokenizer = Tokenizer.from_dir(cache / "default-random-llama")
    assert tp2["prompt_tokens"] == len(tokenizer.encode(DEFAULT_PROMPT))
    assert tp2["output_text"] == tokenizer.decode(ids)
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


def test_readable_output_reports_the_json_figures(cache, tp2):
    """The same command without --json: the table shows what the JSON run computed (timings aside)."""
    r = launch(cache, *TP2)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:6] == [
        f"model   {tp2['model']} [LlamaForCausalLM, float32]",
        f"mesh    tp=2 on 2 cpu device(s); {tp2['parameter_bytes_per_device'] / 2**20:.1f} MiB of weights per device",
        f"cache   {tp2['kv_pages_per_replica']} pages of {tp2['page_size']} tokens per replica, float32 "
        f"({tp2['kv_bytes_per_token_per_device']} bytes a token per device); "
        f"attention backend {tp2['attention_backend']}",
        f"prompt  {tp2['prompt_tokens']} tokens",
        f"output  {tp2['output_text']!r}",
        f"        4 tokens, finish_reason={tp2['finish_reason']}",
    ]
    assert "random weights" in lines[0] and tp2["model"].startswith(str(cache))
    number = r"\d+\.\d+"
    assert re.fullmatch(rf"prefill {number} s \({number} tokens/s\)", lines[6]), lines[6]
    assert re.fullmatch(rf"decode  {number} s \({number} tokens/s\)", lines[7]), lines[7]
    assert re.fullmatch(rf"compile {number} s \(not counted above\)", lines[8]), lines[8]
    assert len(lines) == 9                                     # a dense model: no expert-load line


def test_pipeline_run_reports_its_hop_and_its_bubble(cache, tp2):
    r = launch(cache, "--mesh", "pp=2,tp=2", "--max-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    pp = json.loads(r.stdout)
    assert pp["output_token_ids"] == tp2["output_token_ids"]
    decode = pp["collectives"]["decode"]
    # per stage: its half of the layers' all-reduces, the embedding's (stage 0), the sampled ids' (over pp)
    assert decode["all-reduce"]["count"] == 2 * LAYERS // 2 + 2
    assert decode["collective-permute"] == {"count": 1, "bytes": DEFAULT["hidden_size"] * 4}
    assert pp["pipeline_utilisation"] == 0.5     # one request: one of the two stages busy at a time


def test_sequence_parallel_run_reports_its_ring_and_its_decode_merge(cache, tp2):
    r = launch(cache, "--mesh", "sp=2,tp=2", "--max-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    sp = json.loads(r.stdout)
    assert sp["output_token_ids"] == tp2["output_token_ids"]
    assert sp["collectives"]["prefill"]["collective-permute"]["count"] == LAYERS      # sp - 1 per layer
    decode = sp["collectives"]["decode"]
    assert decode["collective-permute"]["count"] == 0
    assert decode["all-to-all"]["count"] == LAYERS                   # the merge: one all-to-all per layer
    assert decode["all-gather"]["count"] == LAYERS + 1               # and one all-gather, plus the logits'


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


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia"), reason="a GPU host: the CUDA plugin's check is wanted")
def test_jax_starts_without_a_traceback_on_a_host_without_a_gpu():
    """The CUDA plugin installed to compile for GPUs (jaxinfer.device.gpu_target) checks the CUDA libraries as JAX
    starts, and printed a traceback before every command on a machine that has no GPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    r = subprocess.run([sys.executable, "-c", "import jaxinfer, jax; print(jax.default_backend())"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "cpu"), r.stderr
    assert "Traceback" not in r.stderr and "error" not in r.stderr.lower(), r.stderr
