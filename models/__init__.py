"""Model architectures, installed as jaxinfer.models: the registry and the built-in Llama family."""

from jaxinfer.models.base import (
    ARCHITECTURES,
    Model,
    architecture_for,
    config_from_dict,
    config_from_dir,
    model_for,
    register,
)
from jaxinfer.models.llama import Llama

__all__ = ["ARCHITECTURES", "Llama", "Model", "architecture_for", "config_from_dict", "config_from_dir", "model_for",
           "register"]
