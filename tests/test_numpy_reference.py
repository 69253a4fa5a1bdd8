"""Architectures against an independent float64 numpy forward pass of the Hugging Face tensors: Llama with
attention and MLP biases (transformers' attention_bias / mlp_bias), and a research architecture registered
from this file, outside the package, served through the same engine on one device, tp=2 and dp=2."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from safetensors.numpy import load_file

from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint import ParamSpec
from jaxinfer.config import ModelConfig, decoder_fields
from jaxinfer.device.layers import ACTIVATIONS
from jaxinfer.models import ARCHITECTURES, Llama, config_from_dir, register
from jaxinfer.random_model import DEFAULT, write_random_checkpoint

SMALL = {**DEFAULT, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rope_theta": 500.0}
PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 200, 7], [1] + list(range(100, 130))]
TOL = 1e-4


def numpy_forward(t: dict[str, np.ndarray], c: dict, ids: list[int], mlp) -> np.ndarray:
    """Logits [T, V] of one sequence, in float64; `mlp(h, linear)` is the architecture's feed-forward, where
    linear(h, name) applies model.layers.{l}.mlp.{name} (weight and, if present, bias)."""
    E, H, KV, eps = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    D, T = E // H, len(ids)
    f = lambda name: t[name].astype(np.float64)  # noqa: E731

    def rms(x, w):
        return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)

    def linear(h, name):
        out = h @ f(name + ".weight").T
        return out + f(name + ".bias") if name + ".bias" in t else out

    angles = np.arange(T)[:, None] / c["rope_theta"] ** (np.arange(0, D, 2) / D)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

    def rope(x):
        a, b = x[..., : D // 2], x[..., D // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    x = f("model.embed_tokens.weight")[ids]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, f(p + "input_layernorm.weight"))
        q = rope(linear(h, p + "self_attn.q_proj").reshape(T, H, D))
        k = np.repeat(rope(linear(h, p + "self_attn.k_proj").reshape(T, KV, D)), H // KV, axis=1)
        v = np.repeat(linear(h, p + "self_attn.v_proj").reshape(T, KV, D), H // KV, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + causal
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + linear(np.einsum("hts,shd->thd", a, v).reshape(T, H * D), p + "self_attn.o_proj")
        x = x + mlp(rms(x, f(p + "post_attention_layernorm.weight")), lambda h, n, p=p: linear(h, p + "mlp." + n))
    return rms(x, f("model.norm.weight")) @ f("lm_head.weight").T


def swiglu(h, linear):
    gate = linear(h, "gate_proj")
    return linear(gate / (1 + np.exp(-gate)) * linear(h, "up_proj"), "down_proj")


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def check(llm: LLM, tensors: dict, config: dict, mlp) -> list[list[int]]:
    """Logits of every prompt within TOL of numpy; each greedy token numpy's argmax (or within TOL of it)."""
    for ids, ours in zip(PROMPTS, llm.logits(PROMPTS), strict=True):
        np.testing.assert_allclose(ours, numpy_forward(tensors, config, ids, mlp), atol=TOL, rtol=0)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs, strict=True):
        ref = numpy_forward(tensors, config, ids + out.token_ids[:-1], mlp)[len(ids) - 1:]
        for step, token in enumerate(out.token_ids):
            assert ref[step].max() - ref[step, token] <= TOL, f"step {step}: {token} is not numpy's argmax"
    return [o.token_ids for o in outs]


def test_llama_attention_and_mlp_biases_are_applied(tmp_path):
    config = {**SMALL, "attention_bias": True, "mlp_bias": True}
    path = write_random_checkpoint(tmp_path / "biased", config)
    tensors = load_file(str(path / "model.safetensors"))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.layers.1.self_attn.{name}.bias" in tensors
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.1.mlp.{name}.bias" in tensors
    cfg = config_from_dir(path)
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
    assert cfg.num_params() == sum(a.size for a in tensors.values())
    single = check(LLM(path, dtype="float32"), tensors, config, swiglu)
    assert check(LLM(path, mesh="tp=2", dtype="float32"), tensors, config, swiglu) == single


# ---- a research architecture, defined here and registered from outside jaxinfer --------------------------


@struct.dataclass
class GeluMLP:
    fc_in: Any    # [E, M]
    fc_out: Any   # [M, E]


@register("GeluLlamaForCausalLM")
class GeluLlama(Llama):
    """The Llama block with a plain GELU MLP (no gate), weights mlp.fc_in / mlp.fc_out."""

    @classmethod
    def config(cls, c: dict) -> ModelConfig:
        return ModelConfig(**decoder_fields(c, sliding_window=False))

    def mlp_weights(self, shards: int) -> GeluMLP:
        E, M, m = self.cfg.hidden_size, self.cfg.intermediate_size, "model.layers.{layer}.mlp."
        return GeluMLP(fc_in=ParamSpec((E, M), ("embed", "mlp"), m + "fc_in.weight", perm=(1, 0)),
                       fc_out=ParamSpec((M, E), ("mlp", "embed"), m + "fc_out.weight", perm=(1, 0)))

    def mlp(self, w: GeluMLP, h: jax.Array, ctx) -> jax.Array:
        hidden = jax.nn.gelu(jnp.einsum("bte,em->btm", h, w.fc_in), approximate=True)
        return ctx.constrain(jnp.einsum("btm,me->bte", hidden, w.fc_out), ACTIVATIONS)


@pytest.fixture(scope="module")
def research(tmp_path_factory):
    config = {**SMALL, "architectures": ["GeluLlamaForCausalLM"], "model_type": "gelu_llama",
              "hidden_act": "gelu_pytorch_tanh"}
    path = write_random_checkpoint(tmp_path_factory.mktemp("research") / "gelu", config)
    return path, config, load_file(str(path / "model.safetensors"))


def test_research_architecture_is_registered_with_its_own_weights(research):
    path, _, tensors = research
    assert ARCHITECTURES["GeluLlamaForCausalLM"] is GeluLlama
    assert "model.layers.0.mlp.fc_in.weight" in tensors and "model.layers.0.mlp.gate_proj.weight" not in tensors
    assert config_from_dir(path).architecture == "GeluLlamaForCausalLM"


def test_research_architecture_serves_on_every_layout(research):
    path, config, tensors = research
    mlp = lambda h, linear: linear(gelu_tanh(linear(h, "fc_in")), "fc_out")  # noqa: E731
    outputs = {mesh: check(LLM(path, mesh=mesh, dtype="float32"), tensors, config, mlp)
               for mesh in ("", "tp=2", "dp=2")}
    assert outputs["tp=2"] == outputs[""] == outputs["dp=2"]
