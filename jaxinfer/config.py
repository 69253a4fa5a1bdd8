"""Configuration: the model's (from a Hugging Face config.json, pre-v5 and v5 key layouts) and the engine's
serving knobs (one EngineConfig for the library, the launcher and the benchmarks)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

ROPE_KEYS = {  # rope types jaxinfer computes, and the keys each needs
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# jnp references (any platform); the C++ kernel for XLA:CPU; the Pallas GPU kernels (jaxinfer.device.attention)
ATTENTION_BACKENDS = ("xla", "cpu", "pallas")
# weights quantized as they load (jaxinfer.quant); None keeps the checkpoint's own (a pre-quantized one stays so)
QUANTIZATIONS = ("int8", "fp8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")   # auto: the model's dtype; int8/fp8 store pages with scales


def cache_dir() -> Path:
    """Where jaxinfer keeps what it makes: random checkpoints, the compiled CPU kernel, compiled programs."""
    return Path(os.environ.get("JAXINFER_CACHE", Path.home() / ".cache" / "jaxinfer"))


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
    hidden_act: str = "silu"
    qkv_bias: bool = False                 # biases on the q/k/v projections (Qwen2; Llama's attention_bias)
    o_bias: bool = False                   # a bias on the output projection (Llama's attention_bias)
    mlp_bias: bool = False                 # biases on gate/up/down (Llama's mlp_bias)
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
        attn = e * d * (h + 2 * kv) + h * d * e + (d * (h + 2 * kv) if self.qkv_bias else 0) + (e if self.o_bias else 0)
        layer = attn + 2 * e + (2 * d if self.qk_norm else 0)
        mlp = 3 * e * m + ((2 * m + e) if self.mlp_bias else 0)
        experts = self.num_experts * 3 * e * self.moe_intermediate_size + e * self.num_experts
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return (self.num_layers * layer + len(self.mlp_layers) * mlp + len(self.moe_layers) * experts
                + self.vocab_size * e + head + e)


def decoder_fields(c: dict[str, Any], *, sliding_window: bool) -> dict[str, Any]:
    """The ModelConfig fields every decoder-only transformer's config.json gives. `sliding_window`: the
    window (if set) is in use unless `use_sliding_window` says otherwise (Mistral, Mixtral); else only
    where `use_sliding_window` is true (Qwen2/3, whose transformers default is false)."""
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    eos = c.get("eos_token_id")
    return dict(
        architecture=(c.get("architectures") or [""])[0],  # config_from_dict sets the registered name
        vocab_size=c["vocab_size"],
        hidden_size=hidden,
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or hidden // heads,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        **_rope(c),
        max_position_embeddings=_context_length(c, sliding_window),
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        hidden_act=c.get("hidden_act", "silu"),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        pad_token_id=c.get("pad_token_id"),
        checkpoint_dtype=c.get("dtype") or c.get("torch_dtype") or "float32",
    )


def _rope(c: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling from either layout, checked now so that nothing fails at the first step."""
    params = dict(c.get("rope_parameters") or {})  # v5 layout: theta inside
    theta = params.pop("rope_theta", None) or c.get("rope_theta", 10000.0)
    scaling = dict(c.get("rope_scaling") or params)  # pre-v5 layout keeps theta outside
    scaling.pop("rope_theta", None)
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    if kind not in ROPE_KEYS:
        raise ConfigError(f"unsupported rope type {kind!r}; supported: {tuple(ROPE_KEYS)}")
    missing = [k for k in ROPE_KEYS[kind] if not isinstance(scaling.get(k), int | float) or scaling[k] <= 0]
    if missing:
        raise ConfigError(f"rope type {kind!r} needs positive numbers for {', '.join(ROPE_KEYS[kind])}; "
                          f"config.json's rope scaling {scaling} lacks or has a bad {', '.join(missing)}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError(f"llama3 rope needs high_freq_factor > low_freq_factor, got {scaling}")
    partial = c.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor={partial} (rotary embedding on part of each head) is not "
                          f"supported; jaxinfer rotates whole heads")
    return {"rope_theta": float(theta),
            "rope_scaling": tuple(sorted({"rope_type": kind, **scaling}.items())) if kind != "default" else ()}


def _context_length(c: dict[str, Any], window_by_default: bool) -> int:
    """The context jaxinfer serves: max_position_embeddings, capped by a sliding window in use (exact below
    the window; sliding-window attention itself is not implemented)."""
    n = c.get("max_position_embeddings", 4096)
    window = c.get("sliding_window")
    sliding = "sliding_attention" in (c.get("layer_types") or ())
    if window and (c.get("use_sliding_window", window_by_default) or sliding):
        n = min(n, window)
    return n


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return value


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The serving knobs (vLLM's engine arguments), checked at construction."""

    page_size: int = 16                     # tokens per KV page
    num_pages: int | None = None            # KV pages per device (a replica holds sp x); None: from memory
    memory_fraction: float = 0.9            # of device memory for weights + KV pages (gpu_memory_utilization)
    max_num_seqs: int = 32                  # sequences per replica per step
    max_tokens_per_step: int = 256          # token budget per replica per step (rounded up to a power of two)
    prefix_caching: bool = True
    attention_backend: str | None = None    # ATTENTION_BACKENDS; None: the platform's kernel where it serves
    compilation_cache: bool = True          # compiled programs kept on disk (jaxinfer.device.compilation_cache)
    overlap: bool = True                    # schedule step k+1 while step k runs (jaxinfer.engine.core)
    scan_layers: bool | None = None         # one lax.scan per layer stack; None: not for large layers
    quantization: str | None = None         # QUANTIZATIONS: weights quantized as they load
    kv_cache_dtype: str = "auto"            # KV_CACHE_DTYPES

    def __post_init__(self):
        def integer(name: str, value: Any, least: int) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer >= {least}")

        integer("page_size", self.page_size, 1)
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        if self.num_pages is not None:
            integer("num_pages", self.num_pages, 1)
        integer("max_num_seqs", self.max_num_seqs, 1)
        integer("max_tokens_per_step", self.max_tokens_per_step, 1)
        if not (isinstance(self.memory_fraction, int | float) and 0 < self.memory_fraction <= 1
                and math.isfinite(self.memory_fraction)):
            raise ValueError(f"memory_fraction={self.memory_fraction!r} must be in (0, 1]")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"attention backend {self.attention_backend!r} is not one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """The same flags for the launcher and the benchmarks."""
        d = EngineConfig()
        g = p.add_argument_group("engine")
        g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
        g.add_argument("--num-pages", type=int, default=d.num_pages,
                       help="KV pages per device, a dp replica holding sp times as many (default: "
                            "memory_fraction of device memory after the weights; on CPU a 2 GiB budget)")
        g.add_argument("--memory-fraction", type=float, default=d.memory_fraction,
                       help="fraction of device memory for weights + KV pages (like vLLM's gpu_memory_utilization)")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per replica per step")
        g.add_argument("--max-tokens-per-step", type=int, default=d.max_tokens_per_step,
                       help="token budget per replica per step (chunked prefill)")
        g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                       help="do not share the KV pages of common prompt prefixes")
        g.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS,
                       help="xla: the pure-jnp reference; cpu: the C++ kernel for XLA:CPU (CPU default where a "
                            "C++ compiler builds it); pallas: the Pallas GPU kernels (GPU default)")
        g.add_argument("--no-overlap", dest="overlap", action="store_false",
                       help="wait for each step's tokens before scheduling the next (for debugging)")
        g.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=d.scan_layers,
                       help="run the layers as a lax.scan over stacked weights (compile time flat in depth) or "
                            "with each layer reading its own arrays (no copy of them: faster decode); "
                            "default: arrays of their own for layers of more than 4 MiB of weights, else scanned")
        g.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                       help="quantize the weights as they load: int8 or fp8 (float8_e4m3fn), one scale per output "
                            "channel; the embedding, LM head, norms, biases and MoE router stay as stored")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                       help="KV cache storage: auto (the model's dtype), int8 or fp8, with scales")
        g.add_argument("--no-compilation-cache", dest="compilation_cache", action="store_false",
                       help="compile every bucket afresh instead of loading it from $JAXINFER_CACHE/xla")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
