"""Model architectures, installed as jaxinfer.models. Each module exposes param_specs, forward, lm_head."""

from types import ModuleType

from jaxinfer.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from jaxinfer.models import llama

ARCHITECTURES: dict[str, ModuleType] = {arch: llama for arch in SUPPORTED_ARCHITECTURES}


def model_for(cfg: ModelConfig) -> ModuleType:
    if cfg.architecture not in ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {cfg.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[cfg.architecture]
