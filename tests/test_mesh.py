"""MeshConfig parsing, presets, Mesh construction, and the model-dependent checks of sharding.validate."""

import json
import shutil
import tomllib
from importlib import resources

import jax
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.mesh import AXES, MeshConfig, MeshError
from jaxinfer.models import config_from_dict, config_from_dir
from jaxinfer.sharding import kv_head_repeat, validate, validate_sp


def packaged_presets() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files("jaxinfer.meshes").iterdir()
                  if p.name.endswith(".toml"))


@pytest.fixture(scope="module")
def llama(hf_tiny) -> ModelConfig:
    return config_from_dir(hf_tiny / "llama")


@pytest.fixture(scope="module")
def qwen3(hf_tiny) -> ModelConfig:
    return config_from_dir(hf_tiny / "qwen3")


@pytest.fixture(scope="module")
def llama_variant(hf_tiny):
    """(**config.json changes) -> the ModelConfig of the tiny Llama's config.json so changed."""
    def variant(**changes) -> ModelConfig:
        c = json.loads((hf_tiny / "llama" / "config.json").read_text())
        c.update(changes)
        return config_from_dict(c)
    return variant


# ---- parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, shape", [
    ("tp=8", (1, 1, 8, 1, 1)),
    ("dp=2,tp=4", (2, 1, 4, 1, 1)),
    ("", (1, 1, 1, 1, 1)),
    (None, (1, 1, 1, 1, 1)),
    (" tp = 2 ", (1, 1, 2, 1, 1)),
    ("tp=2, dp=2", (2, 1, 2, 1, 1)),
    ("dp=1,pp=2,tp=2,ep=1,sp=2", (1, 2, 2, 1, 2)),
])
def test_parse(spec, shape):
    m = MeshConfig.parse(spec)
    assert m.shape == shape
    assert m.size == shape[0] * shape[1] * shape[2] * shape[3] * shape[4]


def test_parse_passes_a_meshconfig_through():
    m = MeshConfig(dp=2, tp=2)
    assert MeshConfig.parse(m) is m


def test_str():
    assert str(MeshConfig.parse("dp=2,tp=4")) == "dp=2,tp=4"
    assert str(MeshConfig.parse("")) == "single device"


@pytest.mark.parametrize("spec, names", [
    ("xp=2", ["'xp'", "dp, pp, tp, ep, sp"]),
    ("tp=2,xp=2", ["'xp'", "dp, pp, tp, ep, sp"]),
    ("tp=0", ["tp=0", ">= 1"]),
    ("dp=-1", ["dp=-1", ">= 1"]),
    ("tp=two", ["tp='two'", "not an integer", "tp=2"]),
    ("tp=2.5", ["tp='2.5'", "not an integer"]),
    ("tp=", ["tp=''", "not an integer"]),
    ("tp=2,tp=4", ["'tp'", "twice"]),
])
def test_parse_errors(spec, names):
    with pytest.raises(MeshError) as e:
        MeshConfig.parse(spec)
    for n in names:
        assert n in str(e.value)


def test_mesh_error_is_a_value_error():
    assert issubclass(MeshError, ValueError)


# ---- presets -----------------------------------------------------------------------------------------


def test_preset_by_path(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text("# two replicas of tp=4\n[mesh]\ndp = 2\ntp = 4\n")
    assert MeshConfig.parse(str(f)) == MeshConfig(dp=2, tp=4)
    assert MeshConfig.from_preset(str(f)) == MeshConfig(dp=2, tp=4)


def test_preset_by_path_ignores_other_tables(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text("[model]\nname = 'x'\n\n[mesh]\ntp = 2\n")
    assert MeshConfig.parse(str(f)) == MeshConfig(tp=2)


@pytest.mark.parametrize("name", packaged_presets() or [pytest.param("none", marks=pytest.mark.skip("no presets"))])
def test_packaged_preset_by_name(name):
    text = (resources.files("jaxinfer.meshes") / f"{name}.toml").read_text()
    expected = MeshConfig(**tomllib.loads(text)["mesh"])
    assert MeshConfig.parse(name) == expected
    assert MeshConfig.parse(f"{name}.toml") == expected      # the suffix is optional


def test_packaged_preset_by_name_equals_by_path(tmp_path):
    names = packaged_presets()
    if not names:
        pytest.skip("no packaged presets in jaxinfer.meshes")
    src = resources.files("jaxinfer.meshes") / f"{names[0]}.toml"
    copy = tmp_path / "copy.toml"
    copy.write_text(src.read_text())
    assert MeshConfig.parse(str(copy)) == MeshConfig.parse(names[0])


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(MeshError) as e:
        MeshConfig.parse("no-such-preset")
    msg = str(e.value)
    assert "'no-such-preset'" in msg
    assert "dp=2,tp=4" in msg                                  # the fix: write the axes directly
    for name in packaged_presets():
        assert name in msg


def test_missing_toml_path_is_refused(tmp_path):
    with pytest.raises(MeshError, match="missing.toml"):
        MeshConfig.parse(str(tmp_path / "missing.toml"))


def test_preset_without_mesh_table(tmp_path):
    f = tmp_path / "nomesh.toml"
    f.write_text("[model]\ntp = 2\n")
    with pytest.raises(MeshError) as e:
        MeshConfig.parse(str(f))
    assert "nomesh.toml" in str(e.value) and "[mesh]" in str(e.value)


def test_preset_invalid_toml(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text("[mesh\ntp = = 2\n")
    with pytest.raises(MeshError) as e:
        MeshConfig.parse(str(f))
    assert "broken.toml" in str(e.value) and "not valid TOML" in str(e.value)


@pytest.mark.parametrize("body, names", [
    ("xp = 2", ["'xp'", "dp, pp, tp, ep, sp"]),
    ("tp = 0", ["tp=0", ">= 1"]),
    ('tp = "2"', ["tp='2'", "integer"]),
    ("tp = 2.0", ["tp=2.0", "integer"]),
    ("tp = true", ["tp=True", "integer"]),
])
def test_preset_bad_values(tmp_path, body, names):
    f = tmp_path / "bad.toml"
    f.write_text(f"[mesh]\n{body}\n")
    with pytest.raises(MeshError) as e:
        MeshConfig.parse(str(f))
    for n in names + ["bad.toml"]:
        assert n in str(e.value)


# ---- devices and the Mesh ----------------------------------------------------------------------------


def test_make_single_device():
    mesh = MeshConfig.parse("").make()
    assert mesh.axis_names == AXES == ("dp", "pp", "tp", "ep", "sp")
    assert mesh.devices.shape == (1, 1, 1, 1, 1)
    assert mesh.devices.flat[0] == jax.devices()[0]


def test_make_uses_the_first_devices():
    mesh = MeshConfig.parse("tp=2").make()
    assert mesh.axis_names == ("dp", "pp", "tp", "ep", "sp")
    assert mesh.devices.shape == (1, 1, 2, 1, 1)
    assert dict(mesh.shape) == {"dp": 1, "pp": 1, "tp": 2, "ep": 1, "sp": 1}
    assert list(mesh.devices.flat) == jax.devices()[:2]
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_make_dp_tp():
    mesh = MeshConfig.parse("dp=2,tp=4").make()
    assert mesh.devices.shape == (2, 1, 4, 1, 1)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices()[:8])


def test_make_with_explicit_devices():
    devices = jax.devices()[::-1]
    mesh = MeshConfig.parse("tp=2").make(devices)
    assert set(mesh.devices.flat) == set(devices[:2])


def test_check_devices():
    MeshConfig.parse("dp=2,tp=4").check_devices(8)
    with pytest.raises(MeshError) as e:
        MeshConfig.parse("dp=4,tp=4").check_devices(8)
    msg = str(e.value)
    assert "dp=4,tp=4" in msg and "16 devices" in msg and "only 8" in msg


def test_make_too_many_devices():
    assert len(jax.devices()) == 8
    with pytest.raises(MeshError) as e:
        MeshConfig.parse("dp=4,tp=4").make()
    assert "16" in str(e.value) and "8" in str(e.value)
    with pytest.raises(MeshError, match="needs 2 devices but only 1"):
        MeshConfig.parse("tp=2").make(jax.devices()[:1])


# ---- model-dependent checks --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["", "tp=2", "tp=4", "tp=8", "dp=2,tp=4", "dp=8"])
def test_validate_accepts(llama, spec):
    validate(llama, MeshConfig.parse(spec))


def test_tp_must_divide_heads(llama):
    assert llama.num_heads == 8
    with pytest.raises(MeshError) as e:
        validate(llama, MeshConfig.parse("tp=3"))
    msg = str(e.value)
    assert "tp=3" in msg and "8 attention heads" in msg


def test_tp_above_kv_heads_replicates(qwen3):
    assert (qwen3.num_heads, qwen3.num_kv_heads) == (8, 4)
    validate(qwen3, MeshConfig.parse("tp=8"))
    validate(qwen3, MeshConfig.parse("tp=2"))


def test_tp_and_kv_heads_must_divide_one_another(llama_variant):
    cfg = llama_variant(num_attention_heads=12, num_key_value_heads=6, head_dim=8, intermediate_size=192)
    validate(cfg, MeshConfig.parse("tp=2"))
    validate(cfg, MeshConfig.parse("tp=6"))
    with pytest.raises(MeshError) as e:
        validate(cfg, MeshConfig.parse("tp=4"))     # 4 divides the 12 heads, but neither 4 | 6 nor 6 | 4
    msg = str(e.value)
    assert "tp=4" in msg and "6 KV heads" in msg


def test_tp_must_divide_mlp(llama_variant):
    cfg = llama_variant(intermediate_size=162)
    with pytest.raises(MeshError) as e:
        validate(cfg, MeshConfig.parse("tp=4"))
    assert "tp=4" in str(e.value) and "162" in str(e.value)


def test_vocab_need_not_divide_tp(llama_variant):
    """The vocabulary is padded to a multiple of tp (tests/test_fixtures.py checks the outputs)."""
    validate(llama_variant(vocab_size=390), MeshConfig.parse("tp=4"))


def test_ep_needs_a_mixture_of_experts_model(llama):
    with pytest.raises(MeshError) as e:
        validate(llama, MeshConfig.parse("ep=2"))
    msg = str(e.value)
    assert "ep=2" in msg and "LlamaForCausalLM" in msg and "use ep=1" in msg


def test_sp_needs_a_page_per_rank_of_a_full_context():
    validate_sp(4, context_length=64, page_size=16)
    with pytest.raises(MeshError, match="sp=8 exceeds the 4 KV pages of the model's 64-token context"):
        validate_sp(8, context_length=64, page_size=16)


def test_pp_needs_a_layer_per_stage(llama):
    validate(llama, MeshConfig.parse(f"pp={llama.num_layers}"))
    with pytest.raises(MeshError) as e:
        validate(llama, MeshConfig.parse(f"pp={llama.num_layers + 1}"))
    msg = str(e.value)
    assert f"pp={llama.num_layers + 1}" in msg and f"{llama.num_layers} layers" in msg


def test_llm_refuses_a_bad_mesh_before_loading(tmp_path, hf_tiny):
    from jaxinfer import LLM

    with pytest.raises(MeshError, match="tp=3"):
        LLM(hf_tiny / "llama", mesh="tp=3", dtype="float32")
    with pytest.raises(MeshError, match="16 devices"):
        LLM(hf_tiny / "llama", mesh="dp=2,tp=8", dtype="float32")
    with pytest.raises(MeshError, match="16 devices"):
        LLM(hf_tiny / "llama", mesh="pp=4,tp=4", dtype="float32")
    with pytest.raises(MeshError, match="pp=5 exceeds the model's 4 layers"):
        LLM(hf_tiny / "llama", mesh="pp=5", dtype="float32")
    # a checkpoint without weights: the mesh error comes before the checkpoint is opened
    d = tmp_path / "cfg-only"
    d.mkdir()
    shutil.copyfile(hf_tiny / "llama" / "config.json", d / "config.json")
    with pytest.raises(MeshError, match="tp=3"):
        LLM(d, mesh="tp=3", dtype="float32")


@pytest.mark.parametrize("tp, expected", [(1, 1), (2, 1), (4, 2), (8, 4)])
def test_kv_head_repeat_llama(llama, tp, expected):
    assert llama.num_kv_heads == 2
    assert kv_head_repeat(llama, tp) == expected


@pytest.mark.parametrize("tp, expected", [(1, 1), (2, 1), (4, 1), (8, 2)])
def test_kv_head_repeat_qwen3(qwen3, tp, expected):
    assert qwen3.num_kv_heads == 4
    assert kv_head_repeat(qwen3, tp) == expected
