"""Converted checkpoints (python -m jaxinfer.convert, orbax): restored onto any mesh they are the very arrays
the safetensors path loads there, quantized or not; broken or foreign directories are refused clearly."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxinfer import LLM, SamplingParams, launch
from jaxinfer import convert as convert_cli
from jaxinfer.checkpoint import CheckpointError
from jaxinfer.converted import MANIFEST, PARAMS
from jaxinfer.quant import QuantArray

PROMPTS = [[1, 5, 9, 33, 7, 2, 100], [1, 40, 41]]


@pytest.fixture(scope="module")
def converted(hf_tiny, tmp_path_factory):
    """converted(name, *flags) -> the fixture `name` converted by the command line, once per module."""
    made = {}

    def make(name: str, *flags: str, src: Path | None = None) -> Path:
        key = (name, flags, src)
        if key not in made:
            out = tmp_path_factory.mktemp("converted") / name
            assert convert_cli.main(["--model", str(src or hf_tiny / name), "--out", str(out), *flags]) == 0
            made[key] = out
        return made[key]
    return make


def assert_same_weights(ours: LLM, theirs: LLM) -> None:
    a, b = jax.tree.leaves(ours.weights), jax.tree.leaves(theirs.weights)
    assert len(a) == len(b) and jax.tree.structure(ours.weights) == jax.tree.structure(theirs.weights)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.sharding == y.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(("name", "written_on", "served_on", "engine_args"), [
    ("llama", "tp=2", "", {}),                                     # one device
    ("llama", "tp=2", "tp=4", {}),                                 # more shards than KV heads: heads repeated
    ("llama", "", "pp=2", {}),                                     # layers regrouped into stages
    ("qwen3_moe", "", "ep=4", {}),
    ("qwen2", "ep=1,tp=2", "dp=2,tp=2", {"scan_layers": False}),   # one stack per layer, tied embeddings
])
def test_restored_on_any_mesh_is_the_safetensors_load(converted, tiny_llm, golden, name, written_on, served_on,
                                                      engine_args):
    out = converted(name, "--mesh", written_on, "--dtype", "float32")
    llm = LLM(out, mesh=served_on, dtype="float32", **engine_args)
    try:
        assert_same_weights(llm, tiny_llm(name, served_on, **engine_args))
        prompts, ref_logits, _, _ = golden(name)
        for i, logits in enumerate(llm.logits(prompts[:2])):
            np.testing.assert_allclose(logits, ref_logits[i, : len(prompts[i])], atol=1e-4, rtol=0)
    finally:
        llm.close()


def test_quantized_as_converted_or_as_it_lands(converted, hf_tiny, tiny_llm):
    """--quantization int8 stores int8 values and scales; a full-precision conversion served with
    quantization="int8" quantizes as it lands: both equal quantizing the safetensors as they load."""
    direct = tiny_llm("llama", "tp=2", quantization="int8")
    for path, args in ((converted("llama", "--quantization", "int8", "--dtype", "float32"), {}),
                       (converted("llama", "--mesh", "tp=2", "--dtype", "float32"), {"quantization": "int8"})):
        llm = LLM(path, mesh="tp=2", dtype="float32", **args)
        try:
            assert llm.quantization == direct.quantization
            assert llm.parameter_bytes_per_device() == direct.parameter_bytes_per_device()
            assert_same_weights(llm, direct)
        finally:
            llm.close()
    stored = json.loads((converted("llama", "--quantization", "int8", "--dtype", "float32") / MANIFEST).read_text())
    assert stored["quantization"] == "int8" and stored["dtype"] == "float32"
    with pytest.raises(ValueError, match="converted quantized \\(int8\\).* cannot be served as quantization='fp8'"):
        LLM(converted("llama", "--quantization", "int8", "--dtype", "float32"), quantization="fp8")


def test_a_prequantized_checkpoint_stays_as_stored(converted, tmp_path_factory, hf_tiny):
    from quantized_checkpoints import write

    src, _ = write(hf_tiny / "qwen3", tmp_path_factory.mktemp("fp8") / "qwen3-fp8", "fp8", block=(32, 48))
    path = converted("qwen3-fp8", "--dtype", "float32", src=src)
    assert json.loads((path / MANIFEST).read_text())["stored_dtypes"]
    direct, llm = (LLM(p, mesh="tp=2", dtype="float32", compilation_cache=False) for p in (src, path))
    try:
        assert_same_weights(llm, direct)
        assert llm.parameter_bytes_per_device() == direct.parameter_bytes_per_device()
    finally:
        llm.close()
        direct.close()


def test_bfloat16_and_the_tokenizer_come_along(converted, hf_tiny):
    path = converted("llama", "--dtype", "bfloat16")
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert {"tokenizer.json", "generation_config.json"} <= {f.name for f in path.iterdir()}
    assert not list(path.glob("*.safetensors"))
    llm = LLM(path)   # dtype "auto": the stored one
    try:
        # on CPU the matmul weights are held with unit scales for the C++ matmul (jaxinfer.device.matmul)
        held = jax.tree.leaves(llm.weights, is_leaf=lambda x: isinstance(x, QuantArray))
        assert {(x.values if isinstance(x, QuantArray) else x).dtype for x in held} == {np.dtype("bfloat16")}
        reference = LLM(hf_tiny / "llama", dtype="bfloat16")
        params = SamplingParams(max_tokens=5, temperature=0)
        assert llm.generate(["Hello there"], params)[0].text == reference.generate(["Hello there"], params)[0].text
        reference.close()
    finally:
        llm.close()


def broken(converted, tmp_path: Path, how: str) -> Path:
    path = tmp_path / how
    shutil.copytree(converted("llama", "--dtype", "float32"), path)
    if how == "unfinished":
        (path / PARAMS / "layers_0" / "_CHECKPOINT_METADATA").unlink()
    elif how == "truncated":
        for f in (path / PARAMS / "layers_0").rglob("*"):
            if f.is_file() and f.parent.name == "d":   # the arrays' data files
                f.unlink()
    elif how == "old layout":
        manifest = json.loads((path / MANIFEST).read_text())
        (path / MANIFEST).write_text(json.dumps(manifest | {"layout_version": 0}))
    elif how == "foreign":
        shutil.rmtree(path)
        with ocp.StandardCheckpointer() as w:
            w.save(path / "state", {"w": np.zeros((4, 4), np.float32)})
        shutil.copyfile(converted("llama", "--dtype", "float32") / "config.json", path / "config.json")
    return path


@pytest.mark.parametrize(("how", "message"), [
    ("unfinished", "incomplete: params/layers_0 missing or unfinished; convert it again"),
    ("truncated", "params/layers_0 cannot be read as this model's weights .*convert it again"),
    ("old layout", "holds layout version 0 .* this jaxinfer reads version 1: convert it again"),
    ("foreign", "orbax checkpoint that jaxinfer did not write .*python -m jaxinfer.convert"),
])
def test_a_broken_or_foreign_directory_is_refused(converted, tmp_path, capsys, how, message):
    path = broken(converted, tmp_path, how)
    with pytest.raises(CheckpointError, match=message):
        LLM(path, dtype="float32")
    assert launch.main(["--model", str(path), "--max-tokens", "1"]) == 2
    assert "convert" in capsys.readouterr().err


def test_convert_refuses_bad_input(converted, hf_tiny, tmp_path, capsys):
    taken = converted("llama", "--dtype", "float32")
    assert convert_cli.main(["--model", str(hf_tiny / "llama"), "--out", str(taken)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert convert_cli.main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert convert_cli.main(["--model", str(hf_tiny / "llama"), "--out", str(tmp_path / "o"), "--mesh", "tp=3"]) == 2
    assert not (tmp_path / "o").exists()


def test_two_processes_restore_what_one_does(converted, tmp_path, two_processes, tiny_llm):
    """Each process reads its devices' slices (launch/local.sh, dp=2,tp=2 over two processes)."""
    path = converted("llama", "--dtype", "float32")
    flags = ["--mesh", "dp=2,tp=2", "--model", str(path), "--prompt", "Restored twice", "--max-tokens", "6",
             "--json"]
    result = two_processes(flags, tmp_path)
    alone = tiny_llm("llama", "dp=2,tp=2").generate(["Restored twice"], SamplingParams(max_tokens=6, temperature=0))
    assert result["devices"] == 4 and result["output_token_ids"] == alone[0].token_ids
