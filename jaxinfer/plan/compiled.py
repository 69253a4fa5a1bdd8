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
import jax.numpy as jnp

from jaxinfer.checkpoint import abstract, is_spec
from jaxinfer.collectives import KINDS, Report, collective_report
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.device.layers import stacks_as_run
from jaxinfer.device.matmul import gemm_layouts
from jaxinfer.device.pipeline import stage_specs
from jaxinfer.engine.core import Engine
from jaxinfer.engine.packer import token_bucket
from jaxinfer.engine.scheduler import SchedulerOutput
from jaxinfer.mesh import MeshConfig
from jaxinfer.models import model_for
from jaxinfer.models.llama import Experts
from jaxinfer.quant import QTYPES, QuantArray, qtype_name
from jaxinfer.quant_formats import STORED_QTYPES, StoredQuantization, quantized_specs
from jaxinfer.sharding import Layout, device_bytes


@dataclasses.dataclass(frozen=True)
class CompiledLayout:
    """Per device: the bytes of its weights (of which its MoE experts') and of one token's K/V (all its layers,
    scales included), and the collectives of the decode step and the prefill chunk (jaxinfer.collectives
    reports)."""

    weight_bytes: int
    expert_bytes: int               # a step reads only the experts its tokens chose (jaxinfer.plan.roofline)
    kv_bytes_per_token: int
    decode: Report
    prefill: Report
    decode_shape: tuple[int, int]    # (tokens, sequences) per replica of the compiled decode step
    prefill_shape: tuple[int, int]
    weight_bytes_by_dtype: dict[str, int]   # weight_bytes by the dtype the matmuls read them in (`bytes_by_dtype`)


def layout_engine(cfg: ModelConfig, mesh: MeshConfig, dtype, config: EngineConfig, decode_seqs: int = 1,
                  devices: list | None = None, stored: StoredQuantization | None = None) -> Engine:
    """The engine of the layout on the first mesh.size of `devices` (default: all), built as LLM builds it
    (its weights stacked, quantized and laid out the same way) on the weights' shapes, its KV pool's shapes
    (nothing allocated), room for `decode_seqs` sequences per replica: it compiles steps and runs none.
    stored: a pre-quantized checkpoint's scheme (jaxinfer.quant_formats.stored_quantization), every matmul
    weight taken as stored in it."""
    layout = Layout(mesh.make(devices))
    model = model_for(cfg)
    specs = stacks_as_run(stage_specs(model, layout), dtype, config.scan_layers, layout.axis_size("layers"))
    stored_dtype = {q: name for name, q in STORED_QTYPES.items()}[stored.qtype] if stored else None
    specs = quantized_specs(specs, config.quantization, stored, stored and (lambda name: stored_dtype))
    weights = gemm_layouts(jax.tree.map(lambda s: abstract(s, dtype, layout.sharding), specs, is_leaf=is_spec), layout)
    config = dataclasses.replace(config, compilation_cache=False, max_num_seqs=max(config.max_num_seqs, decode_seqs))
    return Engine(model, layout, weights, dtype, config, allocate=False)


def decode_shape(engine: Engine, seqs: int) -> tuple[int, int]:
    """(tokens, sequences) per replica of the decode bucket that holds `seqs` sequences."""
    seqs = 1 << (seqs - 1).bit_length()
    return token_bucket(seqs, engine.sp), seqs


def step_program(engine: Engine, shape: tuple[int, int], ring: bool = False) -> jax.stages.Compiled:
    """The engine's step compiled for a bucket of (tokens, sequences) per replica (and per microbatch under
    pp); ring: a prefill under sp, whose fresh K/V travel the ring."""
    idle = [SchedulerOutput([])] * len(engine.schedulers)
    batch = engine.packer.pack_stages([idle] * engine.stages, shape=shape)
    if ring:
        batch = batch.replace(meta=batch.meta.replace(ring=True))
    if engine.stages > 1:
        engine.runner.fit_carry(shape[0])
    return engine.runner.compile("step", batch)


def expert_weights(weights) -> list:
    """The MoE layers' expert weights in a model's weights (their routers left out: every token reads those)."""
    experts = jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, Experts))
    return [(e.gate_up, e.down) for e in experts if isinstance(e, Experts)]


def bytes_by_dtype(weights, device: jax.Device) -> dict[str, int]:
    """The bytes of `weights` on `device` by the dtype a matmul reads them in ("float32", "bfloat16", "int8",
    "fp8"): a QuantArray's scales count with its values."""
    out: dict[str, int] = {}
    for w in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantArray)):
        dtype = jnp.dtype(w.values.dtype if isinstance(w, QuantArray) else w.dtype)
        name = qtype_name(dtype) if dtype in QTYPES.values() else dtype.name
        out[name] = out.get(name, 0) + device_bytes(w, device)
    return out


def compile_layout(cfg: ModelConfig, mesh: MeshConfig, dtype, config: EngineConfig, decode_seqs: int,
                   devices: list | None = None, programs: bool = True,
                   stored: StoredQuantization | None = None) -> CompiledLayout:
    """Compile the layout's decode step of `decode_seqs` sequences per replica (per microbatch under pp) and its
    prefill chunk of config.max_tokens_per_step tokens, on the first mesh.size of `devices` (default: all).
    programs=False: the bytes alone, nothing compiled (empty reports). stored: a pre-quantized checkpoint's
    scheme (layout_engine)."""
    engine = layout_engine(cfg, mesh, dtype, config, decode_seqs, devices, stored)

    def program(shape: tuple[int, int], ring: bool) -> Report:
        if not programs:
            return {k: {"count": 0, "bytes": 0} for k in KINDS}
        return collective_report(step_program(engine, shape, ring).as_text())

    packer, weights = engine.packer, engine.runner.weights
    decode, prefill = decode_shape(engine, decode_seqs), (packer.max_tokens, min(packer.max_tokens, packer.max_seqs))
    busiest = max(engine.layout.mesh.devices.flat, key=lambda d: device_bytes(weights, d))
    return CompiledLayout(device_bytes(weights, busiest), device_bytes(expert_weights(weights), busiest),
                          engine.kv_bytes_per_token, program(decode, False), program(prefill, engine.sp > 1),
                          decode, prefill, bytes_by_dtype(weights, busiest))
