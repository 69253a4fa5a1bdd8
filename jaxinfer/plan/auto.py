"""`--mesh auto` and LLM(mesh="auto"): the planner's choice for the devices at hand (jaxinfer.plan.planner)."""

from __future__ import annotations

import logging

import jax

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.mesh import MeshConfig, MeshError
from jaxinfer.plan.hardware import KINDS, device_kind
from jaxinfer.plan.planner import Plan, plan
from jaxinfer.plan.workload import Workload
from jaxinfer.quant_formats import StoredQuantization

log = logging.getLogger("jaxinfer")
AUTO = "auto"
AUTO_COMPILES = 4   # layouts `--mesh auto` compiles at most (seconds each on CPU): see plan(prune=...)


def local_device_kind(device: jax.Device) -> str:
    """The planner's name for a device: "cpu", or the accelerator its device_kind names (e.g. "NVIDIA H200")."""
    if device.platform == "cpu":
        return "cpu"
    known = [k for k in KINDS if k in device.device_kind.lower()]
    if not known:
        raise MeshError(f"--mesh auto has no figures for {device.device_kind!r} (it knows {', '.join(KINDS)}); "
                        f"give the mesh, e.g. --mesh tp={len(jax.devices())}")
    return known[0]


def default_workload(cfg: ModelConfig, config: EngineConfig) -> Workload:
    """What a server of this engine config is planned for: max_num_seqs sequences in flight, prompts of up to
    2048 tokens and 256 new ones, within the model's context."""
    output = max(1, min(256, cfg.context_length // 4))
    return Workload(prompt=max(1, min(2048, cfg.context_length - output)), output=output,
                    concurrency=config.max_num_seqs)


def auto_mesh(cfg: ModelConfig, dtype, config: EngineConfig, workload: Workload | None = None,
              devices: list | None = None, compiles: int | None = None,
              stored: StoredQuantization | None = None) -> tuple[MeshConfig, Plan]:
    """The planner's first choice on `devices` (default: every device at hand), compiling at most `compiles`
    (default AUTO_COMPILES) layouts and only what can win (plan(prune=...)), logged with the runner-up; a
    pre-quantized checkpoint's weights (`stored`) planned as it holds them."""
    devices = devices or jax.devices()
    workload = workload or default_workload(cfg, config)
    kind = device_kind(local_device_kind(devices[0]), len(devices))
    result = plan(cfg, len(devices), kind, workload, dtype, config, mesh_devices=devices,
                  prune=compiles or AUTO_COMPILES, stored=stored)
    runner_up = next((c for c in result.ranked[1:] if c.excluded is None), None)
    log.info("--mesh auto on %d %s devices for %s: %s; runner-up: %s", len(devices), kind.name, workload,
             result.why(), f"{runner_up.mesh} ({runner_up.estimate.tokens_per_s:,.0f} tok/s)" if runner_up else "none")
    return result.best.mesh, result
