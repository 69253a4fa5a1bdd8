"""jaxinfer: LLM inference as one JAX/XLA SPMD program on a (dp, pp, tp, ep, sp) device mesh."""

from importlib.metadata import PackageNotFoundError, version

from jaxinfer.config import EngineConfig
from jaxinfer.engine.core import Completion
from jaxinfer.llm import LLM
from jaxinfer.mesh import MeshConfig
from jaxinfer.sampling import SamplingParams

try:
    __version__ = version("jaxinfer")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["LLM", "Completion", "EngineConfig", "MeshConfig", "SamplingParams"]
