"""`python -m jaxinfer.convert`: a Hugging Face checkpoint -> jaxinfer's converted checkpoint (orbax), which
`--model OUT` then restores onto any mesh without converting again (jaxinfer.converted).

    python -m jaxinfer.convert --model /ckpt/Llama-3.1-8B-Instruct --out /ckpt/llama-8b-jax --dtype bfloat16
    python -m jaxinfer.convert --model /ckpt/Qwen3-30B-A3B --out /ckpt/qwen3-moe-int8 --mesh ep=8 --quantization int8
    python -m jaxinfer.launch --model /ckpt/llama-8b-jax --mesh tp=8
"""

from __future__ import annotations

import argparse
import sys

from jaxinfer.cli import DTYPES, add_job_args, job_from_args
from jaxinfer.config import QUANTIZATIONS
from jaxinfer.mesh import mesh_for_cli


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.convert", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--out", required=True, help="the converted checkpoint's directory (new or empty)")
    p.add_argument("--mesh", default="", help="the devices that read and write it, e.g. tp=8 (what is written "
                   "does not depend on it: any mesh restores it)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="the stored dtype (auto: the checkpoint's)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="store the matmul weights quantized (per output channel)")
    add_job_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        job = job_from_args(args)
        mesh = mesh_for_cli(args.mesh, job.num_processes)
        job.initialize()
        import jax

        from jaxinfer.converted import convert
        from jaxinfer.llm import resolve_dtype
        from jaxinfer.models import config_from_dir
        from jaxinfer.sharding import Layout, validate

        cfg = config_from_dir(args.model)
        validate(cfg, mesh)
        mesh.check_devices(len(jax.devices()))
        manifest = convert(args.model, args.out, Layout(mesh.make()), resolve_dtype(args.dtype, cfg),
                           args.quantization)
    except (ValueError, OSError) as e:   # CheckpointError, ConfigError and MeshError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        quant = f", {manifest['quantization']} matmul weights" if manifest["quantization"] else ""
        print(f"wrote {args.out}: {manifest['architecture']} in {manifest['dtype']}{quant}, "
              f"{len(manifest['groups'])} groups; serve it with --model {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
