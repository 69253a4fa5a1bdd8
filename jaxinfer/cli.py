"""The command line flags the launcher, the server and the benchmarks share, and what they do with them:
check every flag before JAX starts, join a multi-host job, load the model."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from absl import logging

from jaxinfer.config import EngineConfig
from jaxinfer.distributed import Job
from jaxinfer.mesh import MeshConfig, mesh_for_cli

DTYPES = ["auto", "float32", "bfloat16", "float16"]
DEFAULT_MODEL_NAME = "jaxinfer-random-small"


def add_model_args(p: argparse.ArgumentParser) -> None:
    """What to serve and where: the flags the launcher and the server share."""
    p.add_argument("--mesh", default="", help='axes, e.g. "tp=8" or "dp=2,tp=4", a preset name/.toml path, or "auto" '
                   "(the layout planner's choice for the devices at hand, python -m jaxinfer.plan)")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory "
                   "(default: an embedded small random-weight Llama that jaxinfer writes itself)")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--served-model-name", default=None, help="the model name OpenAI requests give "
                   "(server, batch files; default: the --model path, or jaxinfer-random-small)")
    EngineConfig.add_cli_args(p)
    add_job_args(p)


def add_job_args(p: argparse.ArgumentParser) -> None:
    """Joining a multi-host job: the same flags for every command that runs on all hosts."""
    multi = p.add_argument_group("multi-host (every process runs this same command; see launch/)")
    multi.add_argument("--coordinator", default=None, help="host:port of process 0 (env JAXINFER_COORDINATOR)")
    multi.add_argument("--num-processes", type=int, default=None, help="env JAXINFER_NUM_PROCESSES (default 1)")
    multi.add_argument("--process-id", type=int, default=None, help="env JAXINFER_PROCESS_ID")


def job_from_args(args: argparse.Namespace) -> Job:
    return Job.from_flags(args.coordinator, args.num_processes, args.process_id)


def prepare(args: argparse.Namespace) -> tuple[Job, MeshConfig, EngineConfig]:
    """Check every flag before JAX starts and before any weight is read, then join the job (ValueError on a
    bad flag, MeshError included)."""
    job = job_from_args(args)
    mesh = mesh_for_cli(args.mesh, job.num_processes)
    engine_config = EngineConfig.from_cli_args(args)
    job.initialize()
    return job, mesh, engine_config


def served_model_name(args: argparse.Namespace) -> str:
    """The name requests give for the model: --served-model-name, else the --model path, else the default's."""
    return args.served_model_name or args.model or DEFAULT_MODEL_NAME


def load(args: argparse.Namespace, mesh: MeshConfig, engine_config: EngineConfig):
    """(LLM, whether its weights are the embedded random default)."""
    import jax

    from jaxinfer.llm import LLM
    from jaxinfer.random_model import default_model

    logging.set_verbosity(logging.INFO)
    if jax.default_backend() == "cpu":
        logging.info("no accelerator found: running on %d fake CPU devices", len(jax.devices()))
    random_weights = args.model is None
    path = default_model() if random_weights else args.model
    return LLM(path, mesh=mesh, dtype=args.dtype, engine_config=engine_config), random_weights


def bench_command(args: argparse.Namespace, run_fn: Callable[[argparse.Namespace], dict],
                  render: Callable[[dict], str]) -> int:
    """A benchmark's command line: fake devices for --mesh before JAX starts, errors as exit code 2,
    then one JSON object (--json) or the readable table."""
    try:
        mesh_for_cli(args.mesh)
        result = run_fn(args)
    except (ValueError, OSError) as e:  # MeshError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else render(result))
    return 0
