"""config.json keys that change the math: served as transformers computes them, or refused at load with a
message naming the key, never silently ignored."""

import json

import pytest

from jaxinfer.config import ConfigError
from jaxinfer.models import config_from_dict


@pytest.fixture(scope="module")
def qwen2(hf_tiny) -> dict:
    return json.loads((hf_tiny / "qwen2" / "config.json").read_text())


@pytest.fixture(scope="module")
def llama(hf_tiny) -> dict:
    return json.loads((hf_tiny / "llama" / "config.json").read_text())


def with_(c: dict, **kw) -> dict:
    out = {k: v for k, v in c.items() if k not in kw}
    return {**out, **{k: v for k, v in kw.items() if v is not None}}


@pytest.mark.parametrize("arch, keys, capped", [
    ("Qwen2ForCausalLM", {}, False),                                # transformers' default: no sliding window
    ("Qwen2ForCausalLM", {"use_sliding_window": False}, False),
    ("Qwen2ForCausalLM", {"use_sliding_window": True}, True),
    ("Qwen3ForCausalLM", {}, False),
    ("MistralForCausalLM", {}, True),                               # Mistral slides wherever a window is set
    ("LlamaForCausalLM", {}, False),
    ("Qwen2ForCausalLM", {"layer_types": ["full_attention", "sliding_attention"]}, True),
])
def test_sliding_window_caps_the_context_only_where_it_is_used(qwen2, arch, keys, capped):
    c = with_(qwen2, architectures=[arch], max_position_embeddings=4096, sliding_window=1024, use_sliding_window=None)
    cfg = config_from_dict({**c, **keys})
    assert cfg.context_length == (1024 if capped else 4096)


@pytest.mark.parametrize("rope, missing", [
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     "original_max_position_embeddings"),
    ({"rope_type": "linear"}, "factor"),
    ({"type": "linear", "factor": 0}, "factor"),
])
def test_rope_scaling_without_its_keys_is_refused_at_load(llama, rope, missing):
    with pytest.raises(ConfigError) as e:
        config_from_dict(with_(llama, rope_scaling=rope))
    assert missing in str(e.value) and rope.get("rope_type", rope.get("type")) in str(e.value)


def test_a_complete_llama3_rope_loads(llama):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256}
    cfg = config_from_dict(with_(llama, rope_scaling=rope))
    assert cfg.rope == rope


@pytest.mark.parametrize("key, value, says", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "unsupported rope type 'yarn'"),
])
def test_math_jaxinfer_does_not_compute_is_refused(llama, key, value, says):
    with pytest.raises(ConfigError, match=None) as e:
        config_from_dict(with_(llama, **{key: value}))
    assert says in str(e.value)


@pytest.mark.parametrize("arch, keys, want", [
    ("LlamaForCausalLM", {"attention_bias": True}, (True, True, False)),
    ("LlamaForCausalLM", {"mlp_bias": True}, (False, False, True)),
    ("Qwen2ForCausalLM", {"attention_bias": False}, (True, False, False)),   # Qwen2: q/k/v biases always, o never
    ("Qwen3ForCausalLM", {"attention_bias": True}, (True, True, False)),
    ("MistralForCausalLM", {"attention_bias": True, "mlp_bias": True}, (False, False, False)),  # not read there
])
def test_biases_follow_each_architecture(llama, arch, keys, want):
    cfg = config_from_dict({**with_(llama, architectures=[arch]), **keys})
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == want


def test_unknown_architecture_names_the_registry(llama):
    with pytest.raises(ConfigError, match="jaxinfer.models.register"):
        config_from_dict(with_(llama, architectures=["GPT2LMHeadModel"]))
