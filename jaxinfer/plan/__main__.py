"""`python -m jaxinfer.plan`: which mesh for this model, these devices, this workload.

    python -m jaxinfer.plan --model /ckpt/Llama-3.1-70B --devices 8 --device h200 \\
        --workload prompt=2048,output=256,concurrency=64 --tpot-ms 30
    python -m jaxinfer.plan --model config.json --devices 8 --device h100 --json
    python -m jaxinfer.plan --calibrate --devices 8      # measure this machine's figures for --device cpu

Every layout is compiled for fake CPU devices of that count (the devices at hand, where there are enough) and
costed on the device kind's roofline (docs/planner.md); no accelerator is needed to plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxinfer.config import ConfigError, EngineConfig, read_json
from jaxinfer.mesh import MeshError, provide_host_devices
from jaxinfer.plan.hardware import DEVICE_KINDS, device_kind
from jaxinfer.plan.workload import Workload, layouts

DTYPES = ["auto", "float32", "bfloat16", "float16"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.plan", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint directory or a config.json (no weights needed); "
                   "default: the embedded random-weight model's config")
    p.add_argument("--devices", type=int, default=8, help="how many devices to plan for (default 8)")
    p.add_argument("--device", default="cpu", help=f"device kind: {', '.join(DEVICE_KINDS)} (cpu: this machine's "
                   "calibration, or its defaults)")
    p.add_argument("--workload", default=str(Workload()), help="prompt=TOKENS,output=TOKENS,concurrency=SEQUENCES")
    p.add_argument("--ttft-ms", type=float, default=None, help="exclude layouts whose time to first token is longer")
    p.add_argument("--tpot-ms", type=float, default=None, help="exclude layouts whose time per output token is longer")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--calibrate", action="store_true", help="measure this machine's figures on --devices fake CPU "
                   "devices and store them for --device cpu")
    p.add_argument("--json", action="store_true", help="the whole table as one JSON object")
    EngineConfig.add_cli_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.devices < 1:
            raise ValueError(f"--devices {args.devices} must be at least 1")
        provide_host_devices(args.devices)
        if args.calibrate:
            from jaxinfer.plan.calibrate import calibrate

            kind = calibrate(args.devices)
            print(json.dumps(kind.to_json()) if args.json else f"stored {kind}")
            return 0
        device = device_kind(args.device, args.devices)
        workload = Workload.parse(args.workload)
        engine_config = EngineConfig.from_cli_args(args)
        cfg, name, stored = model_config(args.model)
        result = _plan(cfg, name, stored, args, device, workload, engine_config)
    except (ValueError, OSError) as e:   # MeshError and ConfigError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(args.model or name, engine_config)) if args.json
          else result.render(args.model or name, engine_config))
    return 0


def model_config(model: str | None):
    """(ModelConfig, name, stored quantization or None) of a checkpoint directory or a config.json; the embedded
    default's without one."""
    from jaxinfer.models import config_from_dict
    from jaxinfer.quant_formats import stored_quantization
    from jaxinfer.random_model import DEFAULT

    if model is None:
        return config_from_dict(dict(DEFAULT)), "jaxinfer-random-small", None
    config = config_json(model)
    return config_from_dict(config), str(model), stored_quantization(config)


def config_json(model: str) -> dict:
    """The config.json of a checkpoint directory, or the file itself."""
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"{model} is neither a checkpoint directory with a config.json nor a config.json")
    return read_json(path)


def _plan(cfg, name, stored, args, device, workload, engine_config):
    import jax

    from jaxinfer.llm import resolve_dtype
    from jaxinfer.plan.planner import plan

    layouts(cfg, args.devices, workload, engine_config.page_size)   # none at all: refused before JAX starts
    at_hand = jax.devices()
    devices = at_hand if len(at_hand) >= args.devices else jax.devices("cpu")
    if len(devices) < args.devices:
        raise MeshError(f"{args.devices} fake CPU devices were asked for but JAX has {len(devices)}: run the plan "
                        f"in a process of its own")
    return plan(cfg, args.devices, device, workload, resolve_dtype(args.dtype, cfg), engine_config,
                ttft_s=None if args.ttft_ms is None else args.ttft_ms / 1e3,
                tpot_s=None if args.tpot_ms is None else args.tpot_ms / 1e3, mesh_devices=devices, name=name,
                progress=lambda mesh: print(f"compiling {mesh}", file=sys.stderr) if not args.json else None,
                stored=stored)


if __name__ == "__main__":
    sys.exit(main())
