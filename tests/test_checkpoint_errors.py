"""Broken checkpoints are refused with a message naming the file or tensor, before anything compiles;
and Checkpoint.read returns exactly the requested shard of our layout (checked against numpy by hand)."""

import json
import shutil
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxinfer.llm
from jaxinfer import LLM
from jaxinfer.checkpoint import Checkpoint, CheckpointError, FusedSpec, SafetensorsFile, load_params, named_specs
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.device.layers import Weights
from jaxinfer.mesh import MeshConfig
from jaxinfer.models import config_from_dir, model_for
from jaxinfer.sharding import Layout, kv_head_repeat

ST = "model.safetensors"


def copy_fixture(src: Path, dst: Path) -> Path:
    """A writable copy (the fixtures are read-only, and copytree would keep that)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)
    return dst


@pytest.fixture
def llama_dir(tmp_path, hf_tiny) -> Path:
    return copy_fixture(hf_tiny / "llama", tmp_path / "llama")


@pytest.fixture
def qwen2_dir(tmp_path, hf_tiny) -> Path:
    return copy_fixture(hf_tiny / "qwen2", tmp_path / "qwen2")


def weight_specs(cfg: ModelConfig, kv_repeat: int = 1, shards: int = 1) -> Weights:
    """The model's weights as specs (what LLM loads), fused ones stored in `shards` column blocks."""
    return model_for(cfg).weights(kv_repeat=kv_repeat, column_shards=shards)


def layer_specs(cfg: ModelConfig, kv_repeat: int = 1):
    """The one LayerStack of a dense model: every layer's weights stacked on a leading "layers" axis."""
    [stack] = weight_specs(cfg, kv_repeat).layers
    assert stack.first == 0 and stack.size == cfg.num_layers
    return stack.weights


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    """Every error here must come before the engine (and so any compilation) exists."""
    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built: the error did not come before compilation")
    monkeypatch.setattr(jaxinfer.llm, "Engine", refuse)


def rewrite(path: Path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def message(excinfo) -> str:
    return str(excinfo.value)


# ---- directory and config.json -----------------------------------------------------------------------


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError) as e:
        LLM(missing, dtype="float32")
    assert str(missing) in message(e) and "does not exist" in message(e)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(missing)
    assert str(missing) in message(e) and "does not exist" in message(e)


def test_a_file_is_not_a_directory(llama_dir):
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(llama_dir / "config.json", dtype="float32")


def test_directory_without_config(llama_dir):
    (llama_dir / "config.json").unlink()
    with pytest.raises(ConfigError) as e:
        LLM(llama_dir, dtype="float32")
    assert str(llama_dir) in message(e) and "config.json" in message(e)


def test_unsupported_architecture(llama_dir):
    c = json.loads((llama_dir / "config.json").read_text())
    c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (llama_dir / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError) as e:
        LLM(llama_dir, dtype="float32")
    msg = message(e)
    assert "GPT2LMHeadModel" in msg
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in msg


def test_config_missing_key(llama_dir):
    c = json.loads((llama_dir / "config.json").read_text())
    del c["intermediate_size"]
    (llama_dir / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError) as e:
        LLM(llama_dir, dtype="float32")
    assert "'intermediate_size'" in message(e) and "LlamaForCausalLM" in message(e)


def test_unsupported_rope_type(llama_dir):
    c = json.loads((llama_dir / "config.json").read_text())
    c["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (llama_dir / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError) as e:
        LLM(llama_dir, dtype="float32")
    assert "'yarn'" in message(e) and "llama3" in message(e)


def test_unknown_dtype(llama_dir):
    with pytest.raises(ValueError) as e:
        LLM(llama_dir, dtype="float64")
    assert "'float64'" in message(e) and "bfloat16" in message(e)


# ---- tensors -------------------------------------------------------------------------------------------


def test_missing_tensor(llama_dir):
    name = "model.layers.2.mlp.up_proj.weight"
    rewrite(llama_dir / ST, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as e:
        LLM(llama_dir, dtype="float32")
    assert f"'{name}'" in message(e) and "(needed for layers.0.weights.mlp.gate_up)" in message(e)


def test_missing_lm_head(llama_dir):
    rewrite(llama_dir / ST, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="'lm_head.weight'"):
        LLM(llama_dir, dtype="float32")


def test_config_does_not_match_weights(llama_dir):
    c = json.loads((llama_dir / "config.json").read_text())
    c["intermediate_size"] = 128                         # the weights have 160
    (llama_dir / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError) as e:
        LLM(llama_dir, dtype="float32")
    msg = message(e)
    assert "mlp.gate_proj.weight" in msg and "[160, 64]" in msg and "[128, 64]" in msg


def test_tensor_of_the_wrong_shape(llama_dir):
    name = "model.layers.1.self_attn.o_proj.weight"                     # [64, 64] in the fixture
    rewrite(llama_dir / ST, lambda t: t.__setitem__(name, np.zeros((64, 48), np.float32)))
    with pytest.raises(CheckpointError) as e:
        LLM(llama_dir, dtype="float32")
    msg = message(e)
    assert f"'{name}'" in msg and "[64, 48]" in msg and "[64, 64]" in msg


def test_unsupported_tensor_dtype(llama_dir):
    rewrite(llama_dir / ST, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].astype(np.int64)))
    with pytest.raises(CheckpointError) as e:
        LLM(llama_dir, dtype="float32")
    msg = message(e)
    assert "'model.norm.weight'" in msg and "I64" in msg and "BF16" in msg


# ---- files ---------------------------------------------------------------------------------------------


def test_truncated_file(llama_dir):
    f = llama_dir / ST
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError) as e:
        Checkpoint(llama_dir)
    msg = message(e)
    assert str(f) in msg and "truncated" in msg and str(len(data) - 100) in msg and str(len(data)) in msg
    with pytest.raises(CheckpointError, match="truncated"):
        LLM(llama_dir, dtype="float32")


@pytest.mark.parametrize("garbage", [b"\xff" * 16, b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!", b"abc"])
def test_corrupt_header(llama_dir, garbage):
    f = llama_dir / ST
    data = f.read_bytes()
    f.write_bytes(garbage + data[len(garbage):] if len(garbage) >= 8 else garbage)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(llama_dir)
    assert str(f) in message(e) and "corrupt header" in message(e)
    with pytest.raises(CheckpointError, match="corrupt header"):
        LLM(llama_dir, dtype="float32")


@pytest.mark.parametrize("header", [b"[1, 2]", b'{"x": 5}', b'{"x": {"dtype": "F32", "shape": [1]}}'])
def test_header_of_the_wrong_structure(llama_dir, header):
    f = llama_dir / ST
    f.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(llama_dir)
    assert str(f) in message(e) and "corrupt header" in message(e)


def test_empty_file(llama_dir):
    (llama_dir / ST).write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        Checkpoint(llama_dir)


def test_no_safetensors(llama_dir):
    (llama_dir / ST).unlink()
    with pytest.raises(CheckpointError) as e:
        Checkpoint(llama_dir)
    assert str(llama_dir) in message(e) and "safetensors" in message(e)
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        LLM(llama_dir, dtype="float32")


def test_pickle_only_checkpoint_is_refused(llama_dir):
    (llama_dir / ST).rename(llama_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only safetensors"):
        LLM(llama_dir, dtype="float32")


def test_sharded_checkpoint_loads_its_index(qwen2_dir):
    ckpt = Checkpoint(qwen2_dir)
    assert len(ckpt.files) == 4
    index = json.loads((qwen2_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert {t: ckpt.where[t].path.name for t in index} == index


def test_index_names_a_missing_shard(qwen2_dir):
    shard = "model-00003-of-00004.safetensors"
    (qwen2_dir / shard).unlink()
    with pytest.raises(CheckpointError) as e:
        Checkpoint(qwen2_dir)
    msg = message(e)
    assert shard in msg and "model.safetensors.index.json" in msg and "missing" in msg
    with pytest.raises(CheckpointError, match=shard):
        LLM(qwen2_dir, dtype="float32")


@pytest.mark.parametrize("text, says", [("{not json", "not a valid safetensors index"),
                                         ("{}", "weight_map"),
                                         ('{"weight_map": {"lm_head.weight": "../x.safetensors"}}', "outside")])
def test_broken_index(qwen2_dir, text, says):
    (qwen2_dir / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(qwen2_dir)
    assert "model.safetensors.index.json" in message(e) and says in message(e)


def test_invalid_config_json_names_the_file(llama_dir):
    (llama_dir / "config.json").write_text("{broken")
    with pytest.raises(ConfigError) as e:
        LLM(llama_dir, dtype="float32")
    assert "config.json" in message(e) and "not valid JSON" in message(e)


def test_index_places_a_tensor_in_the_wrong_shard(qwen2_dir):
    f = qwen2_dir / "model.safetensors.index.json"
    index = json.loads(f.read_text())
    assert index["weight_map"]["lm_head.weight"] == "model-00004-of-00004.safetensors"
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00004.safetensors"
    f.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(qwen2_dir)
    assert "'lm_head.weight'" in message(e) and "model-00001-of-00004.safetensors" in message(e)


# ---- reading slices ------------------------------------------------------------------------------------


def raw_tensors(path: Path) -> dict[str, np.ndarray]:
    """An independent reader (bf16 included): JSON header, then a flat little-endian buffer."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + n])
    header.pop("__metadata__", None)
    dtypes = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
    out = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + a: 8 + n + b], dtypes[t["dtype"]]).reshape(t["shape"])
    return out


@pytest.fixture(scope="module")
def llama_fixture(hf_tiny):
    cfg = config_from_dir(hf_tiny / "llama")
    return cfg, Checkpoint(hf_tiny / "llama"), load_file(str(hf_tiny / "llama" / ST))


def q_heads(hf: np.ndarray, heads: int) -> np.ndarray:
    """q/k/v_proj [N*D, E] -> our [E, N, D]."""
    n_d, e = hf.shape
    return hf.reshape(heads, n_d // heads, e).transpose(2, 0, 1)


def test_read_wq_shard(llama_fixture):
    cfg, ckpt, full = llama_fixture
    spec = layer_specs(cfg).attn.qkv.parts[0]
    got = ckpt.read(spec, (slice(None), slice(None), slice(2, 4), slice(None)))
    assert got.shape == (cfg.num_layers, cfg.hidden_size, 2, cfg.head_dim)
    for layer in range(cfg.num_layers):
        q = full[f"model.layers.{layer}.self_attn.q_proj.weight"]            # [H*D, E]
        np.testing.assert_array_equal(got[layer], q_heads(q, cfg.num_heads)[:, 2:4])


def test_read_wk_replicated_shard(llama_fixture):
    cfg, ckpt, full = llama_fixture
    assert cfg.num_kv_heads == 2
    spec = layer_specs(cfg, kv_repeat=4).attn.qkv.parts[1]                # k: 8 KV heads for tp=8
    assert spec.shape == (cfg.num_layers, cfg.hidden_size, 8, cfg.head_dim)
    got = ckpt.read(spec, (slice(1, 3), slice(None), slice(3, 5), slice(None)))
    assert got.shape == (2, cfg.hidden_size, 2, cfg.head_dim)
    for i, layer in enumerate((1, 2)):
        kv = q_heads(full[f"model.layers.{layer}.self_attn.k_proj.weight"], 2)   # [E, KV, D]
        # replicated heads 3 and 4 are copies of original KV heads 0 (3 // 4) and 1 (4 // 4)
        np.testing.assert_array_equal(got[i, :, 0], kv[:, 0])
        np.testing.assert_array_equal(got[i, :, 1], kv[:, 1])


def test_read_wo_shard(llama_fixture):
    cfg, ckpt, full = llama_fixture
    spec = layer_specs(cfg).attn.o                                        # [L, H, D, E]
    got = ckpt.read(spec, (slice(None), slice(2, 4), slice(None), slice(None)))
    for layer in range(cfg.num_layers):
        o = full[f"model.layers.{layer}.self_attn.o_proj.weight"]            # [E, H*D]
        want = o.reshape(cfg.hidden_size, cfg.num_heads, cfg.head_dim).transpose(1, 2, 0)[2:4]
        np.testing.assert_array_equal(got[layer], want)


def test_read_mlp_and_vocab_shards(llama_fixture):
    cfg, ckpt, full = llama_fixture
    specs = weight_specs(cfg)
    mlp = specs.layers[0].weights.mlp
    L = cfg.num_layers
    got = ckpt.read(mlp.down, (slice(None), slice(40, 80), slice(None)))
    for layer in range(L):
        np.testing.assert_array_equal(got[layer], full[f"model.layers.{layer}.mlp.down_proj.weight"].T[40:80])
    got = ckpt.read(mlp.gate_up.parts[0], (slice(0, 1), slice(None), slice(80, 120)))
    np.testing.assert_array_equal(got[0], full["model.layers.0.mlp.gate_proj.weight"].T[:, 80:120])
    got = ckpt.read(specs.head.lm_head, (slice(None), slice(96, 192)))
    np.testing.assert_array_equal(got, full["lm_head.weight"].T[:, 96:192])
    got = ckpt.read(specs.embed.table, (slice(192, 288), slice(None)))
    np.testing.assert_array_equal(got, full["model.embed_tokens.weight"][192:288])


def our_layout(spec, tensors: dict[str, np.ndarray]) -> np.ndarray:
    """The full parameter in our layout, built with numpy from the HF tensors. A fused one: each part cut
    into `shards` blocks along its column axis, block g of every part side by side, the blocks stacked."""
    if isinstance(spec, FusedSpec):
        cut = [np.split(our_layout(p, tensors), spec.shards, axis=spec.axis) for p in spec.parts]
        blocks = [np.concatenate([c[g] for c in cut], axis=spec.axis) for g in range(spec.shards)]
        return np.stack(blocks, axis=spec.block_axis)

    def one(name):
        a = tensors[name].reshape([d for g in spec.groups for d in g])
        a = np.transpose(a, spec.perm or tuple(range(a.ndim)))
        axis, r = spec.repeat
        return np.repeat(a, r, axis=axis)
    if spec.stack_depth:
        return np.stack([one(n) for n in spec.hf_names()])
    return one(spec.hf)


@pytest.mark.parametrize("fixture, tp", [("llama", 2), ("llama", 8), ("qwen2", 4), ("llama3_scaled", 4)])
def test_every_device_reads_its_shard(fixture, tp, hf_tiny):
    """For each parameter and device of a tp mesh, read(its index) equals the full tensor sliced."""
    cfg = config_from_dir(hf_tiny / fixture)
    ckpt = Checkpoint(hf_tiny / fixture)
    tensors = {}
    for f in sorted((hf_tiny / fixture).glob("*.safetensors")):
        tensors.update(raw_tensors(f))
    layout = Layout(MeshConfig(tp=tp).make())
    repeat = kv_head_repeat(cfg, tp)
    named = named_specs(weight_specs(cfg, repeat, tp))
    # the specs read every tensor of the checkpoint and nothing else
    assert {name for _, spec in named for part in spec.parts for name in part.hf_names()} == set(tensors)
    for key, spec in named:
        full = our_layout(spec, tensors)
        assert full.shape == spec.shape, key
        indices = layout.sharding(spec.axes).devices_indices_map(spec.shape)
        for device, index in indices.items():
            got = ckpt.read(spec, index)
            assert got.dtype == full.dtype, key
            np.testing.assert_array_equal(got, full[index], err_msg=f"{fixture} {key} on {device}")


def test_bf16_fixture_reads_bfloat16(hf_tiny):
    path = hf_tiny / "llama3_scaled"
    cfg = config_from_dir(path)
    assert cfg.checkpoint_dtype == "bfloat16" and cfg.tie_word_embeddings
    ckpt = Checkpoint(path)
    full = raw_tensors(path / ST)
    specs = weight_specs(cfg)
    got = ckpt.read(specs.layers[0].weights.attn.qkv.parts[0], (slice(None), slice(None), slice(1, 3), slice(None)))
    assert got.dtype == ml_dtypes.bfloat16
    for layer in range(cfg.num_layers):
        want = q_heads(full[f"model.layers.{layer}.self_attn.q_proj.weight"], cfg.num_heads)[:, 1:3]
        assert want.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got[layer].view(np.uint16), want.view(np.uint16))
    # tied embeddings: the LM head is the embedding
    assert specs.head.lm_head.hf == "model.embed_tokens.weight"
    got = ckpt.read(specs.head.lm_head, (slice(None), slice(0, 96)))
    np.testing.assert_array_equal(got.view(np.uint16), full["model.embed_tokens.weight"][:96].T.view(np.uint16))


def test_read_is_a_memory_map_view(hf_tiny):
    f = SafetensorsFile(hf_tiny / "llama" / ST)
    a = f.array("model.embed_tokens.weight")
    assert isinstance(a, np.memmap) and not a.flags.writeable              # zero-copy, read-only


def test_load_params_places_each_shard(hf_tiny):
    """A full load on tp=2 (no engine: Engine is patched) places each device's shard correctly."""
    cfg = config_from_dir(hf_tiny / "llama")
    layout = Layout(MeshConfig(tp=2).make())
    specs = weight_specs(cfg, kv_head_repeat(cfg, 2), 2)
    params = load_params(Checkpoint(hf_tiny / "llama"), specs, layout.sharding, np.float32)
    tensors = load_file(str(hf_tiny / "llama" / ST))
    # the same pytree, every spec now an array of its shape and sharding
    named = named_specs(specs)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    assert [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in leaves] == [k for k, _ in named]
    for (key, spec), (_, array) in zip(named, leaves, strict=True):
        assert array.shape == spec.shape and array.dtype == np.float32, key
        assert array.sharding == layout.sharding(spec.axes), key
        np.testing.assert_array_equal(np.asarray(array), our_layout(spec, tensors), err_msg=key)
    wo = params.layers[0].weights.attn.o
    assert wo.sharding.spec == jax.sharding.PartitionSpec(None, "tp", None, None)
    full = our_layout(specs.layers[0].weights.attn.o, tensors)
    assert len(wo.addressable_shards) == 2
    for shard in wo.addressable_shards:
        assert shard.data.shape == (cfg.num_layers, cfg.num_heads // 2, cfg.head_dim, cfg.hidden_size)
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])


def all_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, from all its files."""
    return {name: t for f in sorted(path.glob("*.safetensors")) for name, t in load_file(str(f)).items()}


def hf_columns(tensors, name: str, heads: int, shard: int, shards: int) -> np.ndarray:
    """Shard `shard` of `shards` of a column-parallel HF projection [heads * D, E] (or bias [heads * D]):
    [heads per shard, D, E] ([heads per shard, D]). Heads replicated for tp > heads: a shard of them holds
    source head shard * heads // shards."""
    w = tensors[name]
    per = max(heads // shards, 1)
    first = shard * heads // shards
    return w.reshape(heads, -1, *w.shape[1:])[first: first + per]


@pytest.mark.parametrize("fixture, tp", [("llama", 2), ("qwen2", 2), ("llama", 8)])
def test_fused_weights_hold_each_devices_columns(fixture, tp, hf_tiny):
    """On a tp mesh each device's slice of the fused q/k/v (and bias) and gate/up weights is that device's
    q, k, v (gate, up) column shards of the checkpoint, side by side."""
    path = hf_tiny / fixture
    cfg = config_from_dir(path)
    tensors = all_tensors(path)
    layout = Layout(MeshConfig(tp=tp).make())
    params = load_params(Checkpoint(path), weight_specs(cfg, kv_head_repeat(cfg, tp), tp), layout.sharding,
                         np.float32)
    [stack] = params.layers
    w, H, KV, M = stack.weights, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    attn, mlp = "self_attn.", "mlp."
    # (fused array, its parts: HF tensor and how many heads (columns) it has, whether it is a weight): a
    # weight's blocks follow its input axis, [L, E, G, ...]; a bias's lead, [L, G, ...]
    fused = [(w.attn.qkv, [(attn + "q_proj.weight", H), (attn + "k_proj.weight", KV), (attn + "v_proj.weight", KV)],
              True), (w.mlp.gate_up, [(mlp + "gate_proj.weight", M), (mlp + "up_proj.weight", M)], True)]
    if cfg.qkv_bias:
        fused.append((w.attn.qkv_bias, [(attn + "q_proj.bias", H), (attn + "k_proj.bias", KV),
                                        (attn + "v_proj.bias", KV)], False))
    for array, parts, weight in fused:
        assert len(array.addressable_shards) == tp
        block = 2 if weight else 1
        for shard in array.addressable_shards:
            [g] = range(*shard.index[block].indices(tp))               # one block per device: its shard
            for layer in range(cfg.num_layers):
                got = np.take(np.asarray(shard.data)[layer], 0, axis=block - 1)
                want = np.concatenate([hf_columns(tensors, f"model.layers.{layer}.{name}", heads, g, tp)
                                       for name, heads in parts])
                if weight:                                             # HF [out, E] -> ours [E, out]
                    want = np.moveaxis(want, -1, 0)
                np.testing.assert_array_equal(got, want.reshape(got.shape), err_msg=f"{parts} on device {g}")


@pytest.mark.parametrize("mesh", [MeshConfig(tp=2), MeshConfig(ep=2, tp=2)], ids=str)
def test_fused_expert_weights_hold_each_devices_columns(mesh, hf_tiny):
    """Mixtral's experts: each device's slice of the fused gate/up (w1/w3) weight is, for each of its experts,
    that device's w1 and w3 column shards side by side."""
    path = hf_tiny / "mixtral"
    cfg = config_from_dir(path)
    tensors = all_tensors(path)
    layout = Layout(mesh.make())
    params = load_params(Checkpoint(path), weight_specs(cfg, kv_head_repeat(cfg, mesh.tp), mesh.tp),
                         layout.sharding, np.float32)
    [stack] = params.layers
    gate_up, M = stack.weights.mlp.gate_up, cfg.moe_intermediate_size     # [L, X, E, G, 2M/G]
    assert len(gate_up.addressable_shards) == mesh.size
    for shard in gate_up.addressable_shards:
        experts = range(*shard.index[1].indices(cfg.num_experts))
        [g] = range(*shard.index[3].indices(mesh.tp))
        assert len(experts) == cfg.num_experts // mesh.ep
        for layer in range(cfg.num_layers):
            for i, x in enumerate(experts):
                name = f"model.layers.{layer}.block_sparse_moe.experts.{x}.{{}}.weight"
                want = np.concatenate([hf_columns(tensors, name.format(w), M, g, mesh.tp).transpose(2, 0, 1)
                                       for w in ("w1", "w3")], axis=1)             # experts keep [E, M]
                got = np.asarray(shard.data)[layer, i, :, 0]
                np.testing.assert_array_equal(got, want.reshape(got.shape), err_msg=f"expert {x} on block {g}")


def test_fused_weights_refuse_a_layout_of_other_shards(hf_tiny):
    cfg = config_from_dir(hf_tiny / "llama")
    layout = Layout(MeshConfig(tp=2).make())
    with pytest.raises(ValueError) as e:
        load_params(Checkpoint(hf_tiny / "llama"), weight_specs(cfg, 1, 1), layout.sharding, np.float32)
    assert "attn.qkv is stored in 1 column blocks" in message(e) and "splits them 2 ways" in message(e)
