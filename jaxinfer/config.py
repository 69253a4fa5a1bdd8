"""Model configuration read from a Hugging Face config.json (pre-v5 and v5 key layouts)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# Architectures whose decoder is the Llama block (optionally with q/k/v biases or q/k RMSNorm).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "MixtralForCausalLM": {"moe": True, "norm_topk_prob": True},
    "Qwen3MoeForCausalLM": {"qk_norm": True, "moe": True},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json jaxinfer cannot serve."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # frozen dict: ("rope_type", "llama3"), ("factor", 8.0) ...
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    checkpoint_dtype: str = "float32"
    num_experts: int = 0                   # 0: a dense model
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False           # renormalise the top-k routing weights (always, in Mixtral)
    dense_layers: tuple[int, ...] = ()     # layers of an MoE model that have a dense MLP instead

    @property
    def moe_layers(self) -> tuple[int, ...]:
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def mlp_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    def num_params(self) -> int:
        """Parameter count as stored on disk (embedding and LM head counted twice unless tied)."""
        e, m, h, kv, d = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = e * d * (h + 2 * kv) + h * d * e + (d * (h + 2 * kv) if self.qkv_bias else 0)
        layer = attn + 2 * e + (2 * d if self.qk_norm else 0)
        experts = self.num_experts * 3 * e * self.moe_intermediate_size + e * self.num_experts
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return (self.num_layers * layer + len(self.mlp_layers) * 3 * e * m + len(self.moe_layers) * experts
                + self.vocab_size * e + head + e)

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> ModelConfig:
        archs = c.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or c.get('model_type')!r}; jaxinfer supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        extra = SUPPORTED_ARCHITECTURES[arch]
        try:
            heads = c["num_attention_heads"]
            hidden = c["hidden_size"]
            rope_params = dict(c.get("rope_parameters") or {})  # v5 layout
            theta = rope_params.pop("rope_theta", None) or c.get("rope_theta", 10000.0)
            scaling = dict(c.get("rope_scaling") or rope_params)  # pre-v5 layout keeps theta outside
            scaling.pop("rope_theta", None)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
            scaling = {"rope_type": rope_type, **{k: v for k, v in scaling.items() if k not in ("type",)}}
            eos = c.get("eos_token_id")
            eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
            return cls(
                architecture=arch,
                vocab_size=c["vocab_size"],
                hidden_size=hidden,
                intermediate_size=c["intermediate_size"],
                num_layers=c["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=c.get("num_key_value_heads") or heads,
                head_dim=c.get("head_dim") or hidden // heads,
                rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=tuple(sorted(scaling.items())) if rope_type != "default" else (),
                max_position_embeddings=_context_length(c),
                tie_word_embeddings=c.get("tie_word_embeddings", False),
                qkv_bias=extra.get("qkv_bias", False) or c.get("attention_bias", False),
                qk_norm=extra.get("qk_norm", False),
                bos_token_id=c.get("bos_token_id"),
                eos_token_ids=eos,
                pad_token_id=c.get("pad_token_id"),
                checkpoint_dtype=c.get("dtype") or c.get("torch_dtype") or "float32",
                **(_moe(c, extra) if extra.get("moe") else {}),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks the key {e.args[0]!r} that {arch} needs") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise ConfigError(f"model directory {str(path)!r} does not exist")
        f = path / "config.json"
        if not f.is_file():
            raise ConfigError(f"{str(path)!r} has no config.json: is it a Hugging Face checkpoint directory?")
        cfg = cls.from_dict(_read_json(f))
        gen = path / "generation_config.json"
        if gen.is_file():  # generation_config's EOS list (e.g. Llama 3.1's <|eot_id|>) adds to config.json's
            eos = _read_json(gen).get("eos_token_id")
            eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
            merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *eos]))
            cfg = dataclasses.replace(cfg, eos_token_ids=merged)
        return cfg


def _moe(c: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Mixtral (num_local_experts, every layer sparse) and Qwen3-MoE (num_experts, mlp_only_layers,
    decoder_sparse_step) in one shape."""
    experts = c.get("num_local_experts") or c.get("num_experts")
    step = c.get("decoder_sparse_step") or 1
    dense = {i for i in range(c["num_hidden_layers"]) if (i + 1) % step or i in (c.get("mlp_only_layers") or [])}
    return {"num_experts": experts, "experts_per_token": c["num_experts_per_tok"],
            "moe_intermediate_size": c.get("moe_intermediate_size") or c["intermediate_size"],
            "norm_topk_prob": extra.get("norm_topk_prob", c.get("norm_topk_prob", False)),
            "dense_layers": tuple(sorted(dense))}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return value


def _context_length(c: dict[str, Any]) -> int:
    """The context jaxinfer serves: max_position_embeddings, capped by a sliding window in use."""
    n = c.get("max_position_embeddings", 4096)
    window = c.get("sliding_window")
    if window and c.get("use_sliding_window", True):
        n = min(n, window)  # exact below the window; sliding-window attention itself is not implemented
    return n
