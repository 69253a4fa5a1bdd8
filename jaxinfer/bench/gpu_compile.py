"""`python -m jaxinfer.bench.gpu_compile`: the engine's decode step compiled for an NVIDIA GPU on a machine
without one (jaxinfer.device.gpu_target), and what that program writes per step.

For each weight quantization and batch: the weights' bytes per device, the GEMM kernels of the step (and how
many read 1-byte operands: a quantized weight converted inside the GEMM rather than before it), and the bytes
the step writes per call besides its outputs, with the largest writes (jaxinfer.bench.hlo_writes). A decode
step reads every weight once; a weight-sized write is that weight written and read again on every step, which
a bandwidth-bound step pays for in full. The default model is Llama-3-8B's shape, whose weights are never
made: the engine compiles on their shapes. Autotuning needs a GPU, so the program holds XLA's untuned choice
of GEMM (docs/benchmarks.md#compiled-for-a-gpu-without-one says what that can and cannot show).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time

from jaxinfer.cli import bench_command

VARIANTS = ("none", "int8", "fp8")
GEMM = re.compile(r'"kind":"__triton\w*gemm\w*"|custom_call_target="__cublas')
CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
ONE_BYTE = re.compile(r"\b(?:s8|u8|f8e4m3fn|f8e5m2)\[")


def gemms(hlo: str) -> tuple[int, int]:
    """(GEMM kernels in the program, those with a 1-byte operand)."""
    from jaxinfer.collectives import _parse

    comps, _ = _parse(hlo)
    total = one_byte = 0
    for line in (line for body in comps.values() for line in body if GEMM.search(line)):
        total += 1
        fusion = CALLS.search(line)   # a GEMM fusion's operands are its computation's parameters
        operands = [p for p in comps.get(fusion.group(1), []) if " parameter(" in p] if fusion else [line]
        one_byte += any(ONE_BYTE.search(p.split("=", 1)[1]) for p in operands)
    return total, one_byte


def stored_name(stored) -> str:
    """A checkpoint's stored scheme in a few words: "fp8 128x128 blocks", "int8 per channel"."""
    per = f"{stored.rows}x{stored.cols} blocks" if stored.cols else "per channel" if stored.rows else "per tensor"
    return f"{stored.qtype} {per}"


def run(args: argparse.Namespace) -> dict:
    import jax.numpy as jnp

    from jaxinfer.bench.hlo_writes import largest, written_arrays
    from jaxinfer.config import EngineConfig
    from jaxinfer.device.gpu_target import TARGETS, compile_only_gpus
    from jaxinfer.mesh import MeshConfig
    from jaxinfer.models import config_from_dict
    from jaxinfer.plan.__main__ import config_json
    from jaxinfer.plan.compiled import decode_shape, layout_engine, step_program
    from jaxinfer.quant_formats import stored_quantization
    from jaxinfer.random_model import LLAMA3_8B
    from jaxinfer.sharding import device_bytes

    config = dict(LLAMA3_8B) if args.model is None else config_json(args.model)
    cfg, name = config_from_dict(config), args.model or "Llama-3-8B shape"
    stored = stored_quantization(config)
    variants = [stored_name(stored)] if stored else args.quantization or list(VARIANTS)
    if stored and args.quantization:
        raise ValueError(f"{args.model} is stored quantized ({variants[0]}): leave --quantization out")
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    mesh = MeshConfig.parse(args.mesh)
    if mesh.pp > 1:
        raise ValueError("--mesh with pp: a pipeline's carry is allocated, which compile-only devices cannot hold")
    devices = compile_only_gpus(args.gpu, mesh.size)
    rows = []
    for quantization in variants:
        config = EngineConfig(quantization=None if stored or quantization == "none" else quantization,
                              attention_backend=args.attention_backend)
        engine = layout_engine(cfg, mesh, jnp.bfloat16, config, max(args.batch), devices, stored)
        weights = max(device_bytes(engine.runner.weights, d) for d in devices)
        for batch in args.batch:
            t0 = time.perf_counter()
            hlo = step_program(engine, decode_shape(engine, batch)).as_text()
            writes = written_arrays(hlo)
            kernels, one_byte = gemms(hlo)
            rows.append({"quantization": quantization, "batch": batch, "weight_bytes_per_device": weights,
                         "written_bytes": sum(writes.values()), "gemms": kernels, "one_byte_gemms": one_byte,
                         "largest_writes": largest(writes, args.show_from_mib << 20)[:4],
                         "compile_seconds": time.perf_counter() - t0})
    return {"model": name, "gpu": TARGETS[args.gpu].name, "mesh": str(mesh), "layers": cfg.num_layers,
            "attention_backend": args.attention_backend, "rows": rows}


def readable(r: dict) -> str:
    w = max(7, *(len(x["quantization"]) for x in r["rows"]))
    lines = [f"{r['model']} ({r['layers']} layers), decode step compiled for {r['gpu']} on mesh {r['mesh']} "
             f"({r['attention_backend']} attention); written: bytes per step besides reading the weights once",
             f"{'weights':<{w}} {'batch':>5} {'GiB/device':>10} {'written MiB':>11} {'x weights':>9} {'GEMMs':>6} "
             f"{'1-byte':>6}  largest writes"]
    for x in r["rows"]:
        big = ", ".join(f"{shape} {n / 2**20:.0f} MiB" for _, shape, n in x["largest_writes"][:2]) or "-"
        lines.append(f"{x['quantization']:<{w}} {x['batch']:>5} {x['weight_bytes_per_device'] / 2**30:>10.2f} "
                     f"{x['written_bytes'] / 2**20:>11.1f} {x['written_bytes'] / x['weight_bytes_per_device']:>9.3f} "
                     f"{x['gemms']:>6} {x['one_byte_gemms']:>6}  {big}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.gpu_compile", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory or config.json (default: Llama-3-8B's shape)")
    p.add_argument("--gpu", default="H100", choices=["H100", "H200", "A100"])
    p.add_argument("--mesh", default="", help='e.g. "tp=8" (that many GPUs of one host; no pp)')
    p.add_argument("--quantization", nargs="+", choices=VARIANTS,
                   help="weights quantized as they load (default: all three); a checkpoint stored quantized runs as "
                        "stored")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="sequences per decode step")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the model's, to compile faster")
    p.add_argument("--attention-backend", default="pallas", choices=["pallas", "xla"])
    p.add_argument("--show-from-mib", type=int, default=1, help="list writes of at least this many MiB")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return bench_command(parse_args(argv), run, readable)


if __name__ == "__main__":
    raise SystemExit(main())
