"""jaxinfer: LLM inference as one JAX/XLA SPMD program on a (dp, pp, tp, ep, sp) device mesh."""

import os
from importlib.metadata import PackageNotFoundError, version

# The CUDA PJRT plugin installed with the project (it compiles for GPUs without one: jaxinfer.device.gpu_target)
# checks the CUDA libraries when JAX starts its backends and prints a traceback where they are missing. Without
# an NVIDIA driver there is no GPU to check them for; with one, the check runs.
if not os.path.exists("/proc/driver/nvidia"):
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

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
