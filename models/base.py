"""What an architecture is to jaxinfer, and the registry that maps Hugging Face names to architectures.

An architecture is a `Model` subclass: how its config.json maps to a ModelConfig, its weights with their
logical axes and checkpoint names, and three stage functions the engine runs: `embed`, one decoder
`layer` (scanned over each LayerStack by jaxinfer.device.layers), and `head`. Register one from anywhere,
without editing jaxinfer:

    from jaxinfer.models import Llama, register

    @register("MyLlamaForCausalLM")
    class MyLlama(Llama):
        def mlp(self, w, h, ctx): ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jaxinfer.config import ConfigError, ModelConfig, read_json
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.device.layers import StepContext, Weights

ARCHITECTURES: dict[str, type[Model]] = {}


class Model:
    """One architecture bound to one configuration."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    @classmethod
    def config(cls, c: dict[str, Any]) -> ModelConfig:
        """The ModelConfig of a config.json dict; refuse (ConfigError) what this architecture cannot compute."""
        raise NotImplementedError

    def weights(self, *, kv_repeat: int = 1, vocab_multiple: int = 1, column_shards: int = 1) -> Weights:
        """Every weight as a ParamSpec (shape, logical axes, checkpoint tensor), or a FusedSpec of several.
        kv_repeat: copies of each KV head (so tp may exceed the KV heads); vocab_multiple: pad the vocabulary
        to a multiple of it; column_shards: the shards of the column-parallel (heads, mlp) dimensions, in
        which fused weights are stored."""
        raise NotImplementedError

    def embed(self, w: Any, tokens: jax.Array, ctx: StepContext) -> jax.Array:
        """tokens int32 [R, N] -> activations [R, N, E]."""
        raise NotImplementedError

    def layer(self, w: Any, x: jax.Array, cache: PagedKVCache, layer: jax.Array,
              ctx: StepContext) -> tuple[jax.Array, PagedKVCache, jax.Array | None]:
        """One decoder layer (w: one layer's weights of a LayerStack; layer: its index in the KV cache) ->
        (x, cache, tokens routed to each expert [R, X] or None for a dense layer)."""
        raise NotImplementedError

    def head(self, w: Any, h: jax.Array, ctx: StepContext) -> jax.Array:
        """Hidden states [..., E] -> float32 logits [..., V] (V split over the vocabulary axis)."""
        raise NotImplementedError


def register(name: str) -> Callable[[type[Model]], type[Model]]:
    """Class decorator: serve checkpoints whose config.json lists `name` in "architectures"."""
    def add(cls: type[Model]) -> type[Model]:
        ARCHITECTURES[name] = cls
        return cls
    return add


def architecture_for(c: dict[str, Any]) -> tuple[str, type[Model]]:
    """The first of config.json's "architectures" that is registered, and its class."""
    archs = c.get("architectures") or []
    name = next((a for a in archs if a in ARCHITECTURES), None)
    if name is None:
        raise ConfigError(f"unsupported architecture {archs or c.get('model_type')!r}; jaxinfer supports "
                          f"{', '.join(ARCHITECTURES)} (others can be added with jaxinfer.models.register)")
    return name, ARCHITECTURES[name]


def model_for(cfg: ModelConfig) -> Model:
    if cfg.architecture not in ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {cfg.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[cfg.architecture](cfg)


def config_from_dict(c: dict[str, Any]) -> ModelConfig:
    """A config.json's content through its registered architecture's own mapping (`register`)."""
    name, arch = architecture_for(c)
    try:
        return dataclasses.replace(arch.config(c), architecture=name)
    except KeyError as e:
        raise ConfigError(f"config.json lacks the key {e.args[0]!r} that {name} needs") from None


def config_from_dir(path: str | Path) -> ModelConfig:
    """A Hugging Face checkpoint directory's config.json, with generation_config.json's EOS ids added."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"model directory {str(path)!r} does not exist")
    f = path / "config.json"
    if not f.is_file():
        raise ConfigError(f"{str(path)!r} has no config.json: is it a Hugging Face checkpoint directory?")
    cfg = config_from_dict(read_json(f))
    gen = path / "generation_config.json"
    if gen.is_file():  # generation_config's EOS list (e.g. Llama 3.1's <|eot_id|>) adds to config.json's
        eos = read_json(gen).get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *eos]))
        cfg = dataclasses.replace(cfg, eos_token_ids=merged)
    return cfg
