"""What the planner knows of a device kind: memory, memory bandwidth, matmul rate per dtype, link bandwidth and
latency. Accelerators from their datasheets (below, each figure with its source) times an achievable fraction;
the CPU from this machine's calibration (jaxinfer.plan.calibrate), stored under $JAXINFER_CACHE/plan.

Rates are per device on accelerators. Fake CPU devices share the host's cores and memory, so the CPU kind holds
the host's rates (measured with every device busy at once) and a mesh of n devices gets 1/n of them each.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path

from jaxinfer.config import cache_dir

GB = 1e9
# Fractions of a datasheet peak that serving kernels reach, the roofline's only fudge: decode GEMVs and paged
# attention stream HBM at 75-85% of peak on Hopper (vLLM's and FlashInfer's published kernel figures); dense
# bf16 GEMMs of serving shapes reach about 60-70% of the tensor-core peak (cuBLAS on H100 at M >= 256);
# NCCL's all-reduce bus bandwidth on 8-GPU NVLink boxes is ~80% of the link's one-way rate (nccl-tests).
MEMORY_FRACTION, MATMUL_FRACTION, LINK_FRACTION = 0.8, 0.65, 0.8


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    name: str
    memory_bytes: float           # device memory
    memory_bandwidth: float       # bytes/s achievable
    matmul_rate: dict[str, float]  # flop/s achievable per weight dtype: "bfloat16", "float32", "int8", "fp8"
    link_bandwidth: float         # bytes/s achievable one way per device on the collective's links
    link_latency: float           # seconds per collective call (a small message's time)
    step_overhead: float          # seconds of the engine's host work per step (schedule, pack, dispatch, fetch)
    source: str                   # where the figures come from
    shared: bool = False          # the devices share one host's cores and memory (fake CPU devices): the memory
                                  # bandwidth and matmul rates above are the host's, split over a mesh's devices
    weight_read: dict[str, float] = dataclasses.field(default_factory=dict)
                                  # bytes/s a one-row matmul reads weights of a dtype at, where that is not the
                                  # memory bandwidth: a CPU's C++ matmul converts each 1- or 2-byte weight on the
                                  # way, which costs more than reading it (jaxinfer.plan.calibrate)

    def rate(self, weight_dtype: str) -> float:
        """Matmul rate for weights of this dtype; a dtype the device has no units for runs at bfloat16's."""
        return self.matmul_rate.get(weight_dtype) or self.matmul_rate["bfloat16"]

    def weight_seconds(self, bytes_by_dtype: dict[str, int]) -> float:
        """Seconds to read weights of these bytes per dtype once, as a decode step does."""
        return sum(n / (self.weight_read.get(d) or self.memory_bandwidth) for d, n in bytes_by_dtype.items())

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _gpu(name: str, memory_gb: float, hbm_tb_s: float, bf16_tflops: float, fp8_tflops: float | None,
         int8_tops: float, nvlink_gb_s: float, source: str) -> DeviceKind:
    """From datasheet peaks: dense (not sparse) tensor-core rates; NVLink as the datasheet's total, both ways."""
    rate = {"bfloat16": bf16_tflops * 1e12 * MATMUL_FRACTION, "float16": bf16_tflops * 1e12 * MATMUL_FRACTION,
            "float32": bf16_tflops / 2 * 1e12 * MATMUL_FRACTION,   # TF32 tensor cores: half the bf16 rate
            "int8": int8_tops * 1e12 * MATMUL_FRACTION}
    if fp8_tflops:
        rate["fp8"] = fp8_tflops * 1e12 * MATMUL_FRACTION
    return DeviceKind(name, memory_gb * GB, hbm_tb_s * 1e12 * MEMORY_FRACTION, rate,
                      nvlink_gb_s / 2 * GB * LINK_FRACTION, 10e-6, GPU_STEP_OVERHEAD, source)


# The engine's host work per step on a GPU host: its CPU-side figure on this machine's cores (the CPU
# calibration's step overhead, ~1 ms), which a GPU host's faster cores and overlapped scheduling hide in part.
GPU_STEP_OVERHEAD = 1e-3
# Link latency 10 us: NCCL's small-message all-reduce time within one NVLink node (nccl-tests, 8 GPUs, 8 B).
KINDS: dict[str, DeviceKind] = {
    "h200": _gpu("h200", 141, 4.8, 989, 1979, 1979, 900, "NVIDIA H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s, "
                 "989 TFLOPS bf16 and 1979 TFLOPS fp8/int8 dense, NVLink 900 GB/s"),
    "h100": _gpu("h100", 80, 3.35, 989, 1979, 1979, 900, "NVIDIA H100 SXM datasheet: 80 GB HBM3 at 3.35 TB/s, "
                 "989 TFLOPS bf16 and 1979 TFLOPS fp8/int8 dense, NVLink 900 GB/s"),
    "a100": _gpu("a100", 80, 2.039, 312, None, 624, 600, "NVIDIA A100 SXM 80GB datasheet: 2.039 TB/s HBM2e, "
                 "312 TFLOPS bf16, 624 TOPS int8, no fp8 units (fp8 weights run at bf16's rate), NVLink 600 GB/s"),
}
DEVICE_KINDS = (*KINDS, "cpu")


def calibration_path() -> Path:
    """One file per host and device count: fake CPU devices' shares depend on how many share the cores."""
    return cache_dir() / "plan" / f"calibration-{platform.node() or 'host'}.json"


# A CPU's figures before it is calibrated: `python -m jaxinfer.plan --calibrate --devices 8` on the 2-core
# development machine (2026-12-07); a plan for another CPU should be made after calibrating it.
CPU_DEFAULT = DeviceKind("cpu", 3.16 * GB, 19.3 * GB, {"float32": 108e9, "bfloat16": 93.6e9, "int8": 92.2e9,
                                                       "fp8": 92.8e9},
                         link_bandwidth=1.07 * GB, link_latency=831e-6, step_overhead=3.04e-3,
                         source="defaults: a 2-core development machine, 8 fake devices", shared=True,
                         weight_read={"float32": 19.5 * GB, "bfloat16": 14.3 * GB, "int8": 8.77 * GB, "fp8": 8.04 * GB})


def device_kind(name: str, devices: int) -> DeviceKind:
    """A kind by name (DEVICE_KINDS); "cpu" from this machine's calibration for `devices` fake devices if there is
    one, else CPU_DEFAULT. ValueError for a name it does not know."""
    if name in KINDS:
        return KINDS[name]
    if name != "cpu":
        raise ValueError(f"unknown device kind {name!r}; known: {', '.join(DEVICE_KINDS)}")
    path = calibration_path()
    if path.is_file():
        stored = json.loads(path.read_text()).get(str(devices))
        if stored:
            return DeviceKind(**stored)
    return CPU_DEFAULT
