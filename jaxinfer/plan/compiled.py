"""A layout's step programs compiled without its weights: what each device holds and what it sends per step.

The planner builds the engine of the layout on the weights' shapes (jax.ShapeDtypeStruct in their shardings,
as LLM does while the real ones load) and its KV pool's shapes (nothing allocated), and compiles, without running, the
decode step and the prefill chunk it would run: the same programs the engine compiles for those buckets, so
their collectives (jaxinfer.collectives, from the compiled HLO) are the engine's own. The devices may be fake
CPU devices of that count: a plan needs no accelerator. Where XLA:CPU and XLA:GPU differ (a reduce-scatter +
all-gather pair XLA:GPU may form from an all-reduce, async collectives the GPU overlaps with compute) the CPU's
program is what is counted; docs/planner.md says so.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxinfer.checkpoint import abstract, is_spec
from jaxinfer.collectives import KINDS, Report, collective_report
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.device.pipeline import stage_specs
from jaxinfer.engine.core import Engine
from jaxinfer.engine.packer import token_bucket
from jaxinfer.engine.scheduler import SchedulerOutput
from jaxinfer.mesh import MeshConfig
from jaxinfer.models import model_for
from jaxinfer.quant_formats import quantized_specs
from jaxinfer.sharding import Layout, device_bytes


@dataclasses.dataclass(frozen=True)
class CompiledLayout:
    """Per device: the bytes of its weights and of one token's K/V (all its layers, scales included), and the
    collectives of the decode step and the prefill chunk (jaxinfer.collectives reports)."""

    weight_bytes: int
    kv_bytes_per_token: int
    decode: Report
    prefill: Report
    decode_shape: tuple[int, int]    # (tokens, sequences) per replica of the compiled decode step
    prefill_shape: tuple[int, int]


def compile_layout(cfg: ModelConfig, mesh: MeshConfig, dtype, config: EngineConfig, decode_seqs: int,
                   devices: list | None = None, programs: bool = True) -> CompiledLayout:
    """Compile the layout's decode step of `decode_seqs` sequences per replica (per microbatch under pp) and its
    prefill chunk of config.max_tokens_per_step tokens, on the first mesh.size of `devices` (default: all).
    programs=False: the bytes alone, nothing compiled (empty reports)."""
    layout = Layout(mesh.make(devices))
    model = model_for(cfg)
    specs = quantized_specs(stage_specs(model, layout), config.quantization)
    weights = jax.tree.map(lambda s: abstract(s, dtype, layout.sharding), specs, is_leaf=is_spec)
    config = dataclasses.replace(config, compilation_cache=False, max_num_seqs=max(config.max_num_seqs, decode_seqs))
    engine = Engine(model, layout, weights, dtype, config, allocate=False)
    idle = [SchedulerOutput([])] * len(engine.schedulers)
    packer, runner = engine.packer, engine.runner

    def program(shape: tuple[int, int], ring: bool) -> Report:
        if not programs:
            return {k: {"count": 0, "bytes": 0} for k in KINDS}
        batch = packer.pack_stages([idle] * engine.stages, shape=shape)
        if ring:   # prefill under sp: fresh K/V travel the ring
            batch = batch.replace(meta=batch.meta.replace(ring=True))
        if engine.stages > 1:
            runner.fit_carry(shape[0])
        return collective_report(runner.compile("step", batch).as_text())

    seqs = 1 << (decode_seqs - 1).bit_length()
    decode_shape = (token_bucket(seqs, engine.sp), seqs)
    prefill_shape = (packer.max_tokens, min(packer.max_tokens, packer.max_seqs))
    return CompiledLayout(max(device_bytes(weights, d) for d in layout.mesh.devices.flat),
                          engine.kv_bytes_per_token, program(decode_shape, False),
                          program(prefill_shape, engine.sp > 1), decode_shape, prefill_shape)
