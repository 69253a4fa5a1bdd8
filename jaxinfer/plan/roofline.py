"""The roofline: a layout's step times, throughput and latencies from its compiled bytes and collectives and a
device kind's rates (jaxinfer.plan.hardware).

A step (one call of the engine's program) on a device takes
    max(its matmul and attention FLOPs / matmul rate, the bytes it reads / memory bandwidth)
    + per collective of the compiled program: the link latency + its bytes x (2 for an all-reduce, a ring's
      reduce-scatter and all-gather; else 1) / link bandwidth
    + the engine's host work per step (schedule, pack, dispatch: the device kind's step_overhead).
Bytes read: the device's weights once per call, its MoE experts at the share its tokens chose (`expert_share`),
and the K/V of its share of the sequences' context. Weights of a dtype a device reads slower than its memory
(a CPU's 1- and 2-byte weights, converted by the C++ matmul as it reads them: DeviceKind.weight_read) take
their bytes at that rate.

The workload per replica (dp x ep replicas share the concurrency): B sequences, in M = min(pp, B) microbatches
of b under pp. Decode: each call advances one microbatch by a token and a microbatch passes pp calls per
token, so TPOT = pp x call time and a stage is busy M / pp of the calls (the bubble, 1 - M / pp). Prefill: the
replica's B prompts in chunks of the token budget, pipelined over the stages: ceil(B x prompt / chunk) + pp - 1
calls (the seeds' bubble (pp - 1) / (chunks + pp - 1)); TTFT = a prompt's own chunks + pp - 1 calls.
Throughput: the replicas' output tokens over their prefill and decode time. eta = T_min / (N x T): the
one-device roofline time of the same work (no collectives, memory ignored) over N times this layout's.
"""

from __future__ import annotations

import dataclasses
import math

from jaxinfer.collectives import KINDS, Report
from jaxinfer.config import ModelConfig
from jaxinfer.mesh import MeshConfig
from jaxinfer.plan.compiled import CompiledLayout
from jaxinfer.plan.hardware import DeviceKind
from jaxinfer.plan.workload import Workload

BUS_FACTOR = {"all-reduce": 2.0}   # a ring all-reduce moves its bytes twice (reduce-scatter, then all-gather)


@dataclasses.dataclass(frozen=True)
class Estimate:
    decode_step_s: float          # one call of the decode program
    prefill_step_s: float         # one call of the prefill chunk
    decode_collectives_s: float   # of which collectives
    prefill_collectives_s: float
    ttft_s: float
    tpot_s: float
    tokens_per_s: float           # output tokens per second, all replicas
    bubble: float                 # decode: the fraction of calls a stage idles
    prefill_bubble: float
    eta: float


def collective_seconds(report: Report, device: DeviceKind) -> float:
    return sum(report[k]["count"] * device.link_latency
               + BUS_FACTOR.get(k, 1.0) * report[k]["bytes"] / device.link_bandwidth for k in KINDS)


def matmul_flops_per_token(cfg: ModelConfig, layers: int) -> float:
    """Weight FLOPs per token of `layers` layers (the MoE layers at their routed experts), embedding excluded."""
    e, d = cfg.hidden_size, cfg.head_dim
    attention = 2 * e * d * (cfg.num_heads + 2 * cfg.num_kv_heads) + 2 * cfg.num_heads * d * e
    share = layers / cfg.num_layers
    dense = len(cfg.mlp_layers) * 2 * 3 * e * cfg.intermediate_size
    moe = len(cfg.moe_layers) * (2 * 3 * e * cfg.moe_intermediate_size * cfg.experts_per_token
                                 + 2 * e * cfg.num_experts)
    return share * (cfg.num_layers * attention + dense + moe)


def expert_share(cfg: ModelConfig, mesh: MeshConfig, tokens: float, routed: float | None = None) -> float:
    """The expected share of a device's expert weights one call of `tokens` per replica (its bucket, padding
    included; `routed` of them real, default all) reads: an expert is read when one of the tokens its ep
    group routes (ep x routed / sp, top-k of X each, routing taken as uniform) chose it, 1 - (1 - k / X)^that.
    A decode step of one sequence of Qwen3-30B-A3B (8 of 128 experts) reads 6% of them, a prefill chunk all."""
    if not cfg.num_experts:
        return 1.0
    routed = tokens if routed is None else routed
    return 1 - (1 - cfg.experts_per_token / cfg.num_experts) ** (mesh.ep * routed / mesh.sp)


def attention_flops_per_token(cfg: ModelConfig, layers: int, context: float) -> float:
    return 4 * context * cfg.num_heads * cfg.head_dim * layers


def step_seconds(cfg: ModelConfig, mesh: MeshConfig, device: DeviceKind, weight_dtype: str, held: CompiledLayout,
                 tokens: int, seqs: int, context: float, sampled: int, collectives: float,
                 routed: float | None = None) -> float:
    """One call on the busiest device, which holds `held`'s weights and K/V per token: `tokens` per replica
    (split over sp; `routed` of them real, default all), `seqs` sequences of `context` tokens each whose K/V
    it reads (split over sp), `sampled` rows through the LM head (split over tp)."""
    layers = math.ceil(cfg.num_layers / mesh.pp)
    per_device = tokens / mesh.sp
    flops = (per_device * (matmul_flops_per_token(cfg, layers) + attention_flops_per_token(cfg, layers, context))
             / mesh.tp + 2 * sampled * cfg.hidden_size * cfg.vocab_size / mesh.tp)
    weights = held.weight_bytes - held.expert_bytes * (1 - expert_share(cfg, mesh, tokens, routed))
    read_s = (device.weight_seconds(held.weight_bytes_by_dtype) * weights / max(held.weight_bytes, 1)
              + seqs * context / mesh.sp * held.kv_bytes_per_token / device.memory_bandwidth)
    share = mesh.size if device.shared else 1    # fake CPU devices split the host's rates
    return share * max(flops / device.rate(weight_dtype), read_s) + collectives + device.step_overhead


def estimate(cfg: ModelConfig, mesh: MeshConfig, device: DeviceKind, workload: Workload, compiled: CompiledLayout,
             weight_dtype: str, single: CompiledLayout, chunk: int) -> Estimate:
    """The layout's figures for the workload; `single`: the model on one device (bytes only), for eta;
    `chunk`: the prefill chunk, tokens per replica per step."""
    replicas = mesh.dp * mesh.ep
    seqs = math.ceil(workload.concurrency / replicas)
    micro = min(mesh.pp, seqs)
    per_micro = math.ceil(seqs / micro)
    context = workload.prompt + workload.output / 2
    decode_coll = collective_seconds(compiled.decode, device)
    prefill_coll = collective_seconds(compiled.prefill, device)
    decode = step_seconds(cfg, mesh, device, weight_dtype, compiled, compiled.decode_shape[0], per_micro, context,
                          per_micro, decode_coll, routed=per_micro)
    prefill = step_seconds(cfg, mesh, device, weight_dtype, compiled, chunk, 1, workload.prompt / 2, 1, prefill_coll)
    chunks = math.ceil(seqs * workload.prompt / chunk)
    prefill_total = (chunks + mesh.pp - 1) * prefill
    decode_total = workload.output * mesh.pp * decode
    tokens_per_s = replicas * seqs * workload.output / (prefill_total + decode_total)
    one = MeshConfig()
    t1_decode = step_seconds(cfg, one, device, weight_dtype, single, workload.concurrency, workload.concurrency,
                             context, workload.concurrency, 0.0)
    t1_prefill = step_seconds(cfg, one, device, weight_dtype, single, chunk, 1, workload.prompt / 2, 1, 0.0)
    t_min = math.ceil(workload.concurrency * workload.prompt / chunk) * t1_prefill + workload.output * t1_decode
    t_layout = workload.concurrency * workload.output / tokens_per_s
    return Estimate(decode, prefill, decode_coll, prefill_coll,
                    ttft_s=(math.ceil(workload.prompt / chunk) + mesh.pp - 1) * prefill,
                    tpot_s=mesh.pp * decode, tokens_per_s=tokens_per_s, bubble=1 - micro / mesh.pp,
                    prefill_bubble=(mesh.pp - 1) / (chunks + mesh.pp - 1), eta=t_min / (mesh.size * t_layout))
