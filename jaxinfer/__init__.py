"""jaxinfer: LLM inference as one JAX/XLA SPMD program on a (dp, pp, tp, ep, sp) device mesh."""

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Completion
from jaxinfer.llm import LLM
from jaxinfer.mesh import MeshConfig
from jaxinfer.sampling import SamplingParams

__all__ = ["LLM", "Completion", "EngineConfig", "MeshConfig", "SamplingParams"]
