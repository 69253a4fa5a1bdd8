"""GPUs that are not here: compile-only devices of an NVIDIA GPU, made from XLA's description of one (its
GpuTargetConfig), so that the engine's step programs compile for CUDA on a machine without a GPU and what the
compiler made of them can be read before they run anywhere: which GEMMs, which fusions, and above all which
arrays a step writes besides its outputs (a weight dequantized or transposed on every step is read and
written again: the step then moves more bytes than its weights hold, and decode is bandwidth-bound).

XLA compiles without a device when it is given the target's properties; autotuning, which needs one, is
skipped, so where the GPU's autotuner would choose between a Triton GEMM and cuBLAS the compile-only program
holds XLA's default choice. Needs the CUDA PJRT plugin (`jax[cuda12]`, or `jax[cuda12-local]`: compiling
needs none of the CUDA libraries), neither a GPU nor its driver.
"""

from __future__ import annotations

import dataclasses
import os

import jax


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """The properties XLA:GPU compiles for (the fields of its se::DeviceDescription that a compile reads)."""

    name: str                  # the device_kind a real one reports
    core_count: int            # streaming multiprocessors
    memory_bytes: int
    bandwidth: float           # bytes/s of HBM
    l2_bytes: int
    clock_ghz: float
    compute_capability: tuple[int, int] = (9, 0)
    shared_memory_per_core: int = 233472    # bytes per SM (Hopper's 228 KiB; Ampere's A100 164 KiB)
    shared_memory_per_block_optin: int = 232448

    def config(self) -> str:
        """The target as XLA's GpuTargetConfig text proto."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{self.name}"
"""


TARGETS = {
    "H100": GpuTarget("NVIDIA H100 80GB HBM3", 132, 80 << 30, 3.35e12, 50 << 20, 1.98),
    "H200": GpuTarget("NVIDIA H200", 132, 141 << 30, 4.8e12, 50 << 20, 1.98),
    "A100": GpuTarget("NVIDIA A100-SXM4-80GB", 108, 80 << 30, 2.039e12, 40 << 20, 1.41, (8, 0), 167936, 166912),
}


def compile_only_gpus(kind: str = "H100", count: int = 1) -> list[jax.Device]:
    """`count` compile-only devices of the GPU `kind` (one host): a mesh of them compiles for CUDA, and
    nothing can be placed on them. Raises ValueError for an unknown kind, RuntimeError without the plugin."""
    if kind not in TARGETS:
        raise ValueError(f"unknown GPU {kind!r}: one of {', '.join(TARGETS)}")
    from jax.experimental import topologies

    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")   # the plugin's check of the CUDA libraries
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[kind].config(),
                                                topology=f"1x1x{count}")
    except (NotImplementedError, RuntimeError) as e:
        raise RuntimeError("compiling for a GPU without one needs the CUDA PJRT plugin: pip install "
                           f"'jax[cuda12-local]' (or jax[cuda12]) at jax's version ({e})") from e
    return list(topology.devices)
