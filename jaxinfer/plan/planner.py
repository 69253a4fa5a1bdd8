"""The layout planner: every mesh a model admits on N devices, each compiled (jaxinfer.plan.compiled) and costed
(jaxinfer.plan.roofline), ranked by throughput among those that fit in memory, meet the latency targets and
keep eta >= 0.6 (the seeds' threshold: below it, cut parallelism), each excluded one with its reason."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax.numpy as jnp

from jaxinfer.collectives import Report
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.mesh import MeshConfig
from jaxinfer.plan.compiled import CompiledLayout, compile_layout
from jaxinfer.plan.hardware import DeviceKind
from jaxinfer.plan.roofline import Estimate, estimate
from jaxinfer.plan.workload import Workload, layouts
from jaxinfer.quant_formats import StoredQuantization

MIN_ETA = 0.6


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: MeshConfig
    compiled: CompiledLayout
    estimate: Estimate
    kv_tokens: int          # per replica, in the memory left after the weights
    max_sequences: int      # of the workload's length, over all replicas
    fits: bool
    excluded: str | None    # why it is not a choice; None: it is one
    compiled_programs: bool = True   # False: left out by plan(prune=True), its figures a bound (no collectives)

    def to_json(self) -> dict:
        return {"mesh": str(self.mesh), "axes": dataclasses.asdict(self.mesh), **dataclasses.asdict(self.compiled),
                **dataclasses.asdict(self.estimate), "kv_tokens": self.kv_tokens,
                "max_sequences": self.max_sequences, "fits": self.fits, "excluded": self.excluded,
                "compiled": self.compiled_programs}


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    devices: int
    device: DeviceKind
    workload: Workload
    ranked: list[Candidate]      # choices first, by throughput; then the excluded ones, those that fit first

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    def why(self) -> str:
        """One line on why the first wins."""
        best, rest = self.best, [c for c in self.ranked[1:] if c.excluded is None]
        if best.excluded is not None:
            return f"no layout meets every target; {best.mesh} is the fastest that fits ({best.excluded})"
        margin = (f", {best.estimate.tokens_per_s / rest[0].estimate.tokens_per_s:.2f}x the runner-up {rest[0].mesh}"
                  if rest else ", the only layout that meets every target")
        return (f"{best.mesh}: {best.estimate.tokens_per_s:,.0f} output tok/s{margin}; "
                f"TPOT {best.estimate.tpot_s * 1e3:.1f} ms, TTFT {best.estimate.ttft_s * 1e3:.0f} ms, "
                f"eta {best.estimate.eta:.2f}")

    def command(self, model: str, config: EngineConfig) -> str:
        """The launcher's command line that runs the winner."""
        mesh = str(self.best.mesh) if self.best.mesh.size > 1 else ""
        flags = [f"--mesh {mesh}" if mesh else "", f"--model {model}",
                 f"--max-num-seqs {math.ceil(self.workload.concurrency / (self.best.mesh.dp * self.best.mesh.ep))}",
                 f"--max-tokens-per-step {config.max_tokens_per_step}",
                 f"--quantization {config.quantization}" if config.quantization else "",
                 f"--kv-cache-dtype {config.kv_cache_dtype}" if config.kv_cache_dtype != "auto" else ""]
        return "python -m jaxinfer.serve " + " ".join(f for f in flags if f)


    def to_json(self, model: str, config: EngineConfig) -> dict:
        return {"model": self.model, "devices": self.devices, "device": self.device.to_json(),
                "workload": dataclasses.asdict(self.workload), "why": self.why(),
                "command": self.command(model, config),
                "layouts": [c.to_json() for c in self.ranked]}

    def render(self, model: str, config: EngineConfig) -> str:
        """The table, best first, then why the first wins and the command that runs it."""
        def coll(report: Report, compiled: bool) -> str:
            if not compiled:
                return "-"
            count = sum(r["count"] for r in report.values())
            return f"{count} / {_size(sum(r['bytes'] for r in report.values()))}"

        rows = [("rank", "mesh", "weights/dev", "KV tok/replica", "seqs fit", "decode coll", "prefill coll",
                 "decode ms", "prefill ms", "bubble", "TTFT ms", "TPOT ms", "tok/s", "eta", "verdict")]
        for i, c in enumerate(self.ranked, 1):
            e = c.estimate
            rows.append((str(i), str(c.mesh), _size(c.compiled.weight_bytes), f"{c.kv_tokens:,}",
                         f"{c.max_sequences:,}", coll(c.compiled.decode, c.compiled_programs),
                         coll(c.compiled.prefill, c.compiled_programs),
                         f"{e.decode_step_s * 1e3:.2f}", f"{e.prefill_step_s * 1e3:.1f}", f"{e.bubble:.2f}",
                         f"{e.ttft_s * 1e3:.0f}", f"{e.tpot_s * 1e3:.2f}", f"{e.tokens_per_s:,.0f}", f"{e.eta:.2f}",
                         c.excluded or "ok"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        table = "\n".join("  ".join(f"{v:<{w}}" if j in (1, 14) else f"{v:>{w}}" for j, (v, w) in
                                    enumerate(zip(r, widths, strict=True))).rstrip() for r in rows)
        head = (f"{self.model} on {self.devices} x {self.device.name} ({self.device.source}); workload "
                f"{self.workload}; collectives: count / bytes per device per step, from the compiled programs")
        return f"{head}\n{table}\n\nwinner: {self.why()}\nrun it: {self.command(model, config)}"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def weight_dtype(dtype, config: EngineConfig, stored: StoredQuantization | None = None) -> str:
    return config.quantization or (stored and stored.qtype) or jnp.dtype(dtype).name


def plan(cfg: ModelConfig, devices: int, device: DeviceKind, workload: Workload, dtype, config: EngineConfig,
         ttft_s: float | None = None, tpot_s: float | None = None, mesh_devices: list | None = None,
         progress: Callable[[MeshConfig], None] = lambda mesh: None, name: str = "", prune: int = 0,
         stored: StoredQuantization | None = None) -> Plan:
    """Plan `cfg` on `devices` devices of `device`'s kind for `workload`, compiling on `mesh_devices` (default:
    jax.devices(); fake CPU devices for a plan of other devices).

    prune: compile at most this many layouts, and only what can still win (--mesh auto; 0: compile all).
    Collectives only add time, so a layout's figures with free collectives bound it: layouts are compiled in the
    order of that bound until one is chosen whose throughput no uncompiled layout's bound reaches (then the
    winner is the full plan's), or `prune` are compiled (then it is the best of those); the rest are left out
    with their bound. The runner-up is the best other layout compiled. stored: a pre-quantized checkpoint's
    scheme (jaxinfer.quant_formats.stored_quantization), its weights planned as it holds them."""
    single = compile_layout(cfg, MeshConfig(), dtype, config, 1, mesh_devices, programs=False, stored=stored)

    def candidate(mesh: MeshConfig, programs: bool) -> Candidate:
        return evaluate(cfg, mesh, device, workload, dtype, config, single, ttft_s, tpot_s, mesh_devices, programs,
                        stored)

    bounds = sorted((candidate(m, False) for m in layouts(cfg, devices, workload, config.page_size)),
                    key=lambda c: -c.estimate.tokens_per_s)
    candidates: list[Candidate] = []
    for bound in bounds:
        best = max((c.estimate.tokens_per_s for c in candidates if c.excluded is None), default=0.0)
        spent = sum(c.compiled_programs for c in candidates) >= prune
        final = not bound.fits or (bound.excluded or "").startswith("misses")   # no fallback either
        if prune and ((bound.excluded is not None and (best or final)) or bound.estimate.tokens_per_s < best
                      or spent):
            # excluded even with free collectives (kept, while nothing is chosen, as the fallback where it only
            # misses eta), or it cannot beat the one chosen, or no compiles are left
            why = bound.excluded or f"not compiled: at most {bound.estimate.tokens_per_s:,.0f} tok/s"
            candidates.append(dataclasses.replace(bound, excluded=why))
            continue
        progress(bound.mesh)
        candidates.append(candidate(bound.mesh, True))
    chosen = sorted((c for c in candidates if c.excluded is None), key=lambda c: -c.estimate.tokens_per_s)
    rest = sorted((c for c in candidates if c.excluded is not None),
                  key=lambda c: (not c.fits, not c.compiled_programs, -c.estimate.tokens_per_s))
    return Plan(name or cfg.architecture, devices, device, workload, chosen + rest)


def evaluate(cfg: ModelConfig, mesh: MeshConfig, device: DeviceKind, workload: Workload, dtype, config: EngineConfig,
             single: CompiledLayout, ttft_s: float | None = None, tpot_s: float | None = None,
             mesh_devices: list | None = None, programs: bool = True,
             stored: StoredQuantization | None = None) -> Candidate:
    """One layout compiled (programs=False: its bytes alone, collectives free) and costed; `single`: the model's
    bytes on one device (compile_layout(..., programs=False) of the one-device mesh), for eta."""
    replicas = mesh.dp * mesh.ep
    seqs = math.ceil(workload.concurrency / replicas)
    compiled = compile_layout(cfg, mesh, dtype, config, math.ceil(seqs / min(mesh.pp, seqs)), mesh_devices, programs,
                              stored)
    chunk = 1 << (max(config.max_tokens_per_step, 16) - 1).bit_length()
    est = estimate(cfg, mesh, device, workload, compiled, weight_dtype(dtype, config, stored), single, chunk)
    free = config.memory_fraction * device.memory_bytes - compiled.weight_bytes
    kv_tokens = max(0, int(free // compiled.kv_bytes_per_token)) * mesh.sp
    max_seqs = kv_tokens // (workload.prompt + workload.output) * replicas
    fits = free > 0 and max_seqs >= workload.concurrency
    return Candidate(mesh, compiled, est, kv_tokens, max_seqs, fits,
                     _excluded(compiled, est, fits, free, max_seqs, workload, ttft_s, tpot_s), programs)


def _excluded(compiled: CompiledLayout, est: Estimate, fits: bool, free: float, max_seqs: int, workload: Workload,
              ttft_s: float | None, tpot_s: float | None) -> str | None:
    if free <= 0:
        return f"does not fit: {compiled.weight_bytes / 2**30:.1f} GiB of weights per device"
    if not fits:
        return f"does not fit: KV room for {max_seqs} of the {workload.concurrency} sequences"
    if tpot_s is not None and est.tpot_s > tpot_s:
        return f"misses TPOT: {est.tpot_s * 1e3:.1f} ms > {tpot_s * 1e3:.1f} ms"
    if ttft_s is not None and est.ttft_s > ttft_s:
        return f"misses TTFT: {est.ttft_s * 1e3:.0f} ms > {ttft_s * 1e3:.0f} ms"
    if est.eta < MIN_ETA:
        return f"eta {est.eta:.2f} below {MIN_ETA}"
    return None
