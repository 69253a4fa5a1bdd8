"""What an architecture is to jaxinfer, and the registry that maps Hugging Face names to architectures.

An architecture is a `Model` subclass: how its config.json maps to a ModelConfig, its weights with their
logical axes and checkpoint names, and three stage functions the engine runs: `embed`, one decoder
`layer` (scanned over each LayerStack by jaxinfer.layers), and `head`. Register one from anywhere,
without editing jaxinfer:

    from jaxinfer.models import Llama, register

    @register("MyLlamaForCausalLM")
    class MyLlama(Llama):
        def mlp(self, w, h, ctx): ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.kv_cache import PagedKVCache
from jaxinfer.layers import StepContext, Weights

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
