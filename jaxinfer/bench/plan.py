"""`python -m jaxinfer.bench.plan`: the planner's predictions held against measurement, layout by layout.

    python -m jaxinfer.bench.plan                       # 10 layouts of a dense and an MoE random-weight model
    python -m jaxinfer.bench.plan --layouts tp=2 dp=2 --json

For each layout the planner compiles and costs the workload (jaxinfer.plan.planner.evaluate, on this machine's
calibration, or its defaults where there is none), then the engine serves the same workload: a warm-up burst
(compiles), then the measured burst of --concurrency requests. Decode and prefill step times are the engine's
own (EngineStats: device time of decode-only steps and of steps with prompt tokens, compilation excluded),
throughput the burst's output tokens over its wall time. ratio = measured / predicted. The first choice is the
planner's best among the layouts run; its throughput against the best measured says how good the choice was.
On CPU the fake devices share the cores, so the figures measure this machine, not a GPU's scaling.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from jaxinfer.cli import bench_command
from jaxinfer.config import EngineConfig

DENSE = ["", "tp=2", "dp=2", "pp=2", "sp=2", "dp=2,tp=2", "pp=2,tp=2", "tp=4"]
MOE = ["ep=2", "dp=2,ep=2"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.plan", description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=DENSE, help="dense-model meshes to run")
    p.add_argument("--moe-layouts", nargs="*", default=MOE, help="MoE-model meshes to run")
    p.add_argument("--prompt", type=int, default=96, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=32, help="generated tokens per request")
    p.add_argument("--concurrency", type=int, default=8, help="requests in the burst")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    EngineConfig.add_cli_args(p)
    args = p.parse_args(argv)
    meshes = [m for m in args.layouts + args.moe_layouts if m]
    args.mesh = f"dp={max([1, *(eval_size(m) for m in meshes)])}"   # the devices the largest layout needs
    return args


def eval_size(spec: str) -> int:
    from jaxinfer.mesh import MeshConfig

    return MeshConfig.parse(spec).size


def measure(cfg, mesh: str, workload, config: EngineConfig) -> dict:
    """The engine's step times and throughput for the workload on `mesh` (random weights)."""
    from jaxinfer.llm import LLM
    from jaxinfer.sampling import SamplingParams

    with LLM.random(cfg, mesh=mesh, dtype="float32", engine_config=config) as llm:
        rng = np.random.default_rng(0)
        prompts = lambda: rng.integers(0, cfg.vocab_size, (workload.concurrency, workload.prompt)).tolist()  # noqa: E731
        params = SamplingParams(max_tokens=workload.output, temperature=0, ignore_eos=True)
        llm.generate(prompts(), params)          # warm-up: compiles the same shapes (other prompts: no prefix hits)
        before, t0 = llm.engine.stats.copy(), time.perf_counter()
        outs = llm.generate(prompts(), params)
        seconds, stats = time.perf_counter() - t0, llm.engine.stats - before
    return {"decode_step_s": stats.decode_seconds / max(stats.decode_steps, 1),
            "prefill_step_s": stats.prefill_seconds / max(stats.prefill_steps, 1),
            "tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds}


def run(args: argparse.Namespace) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxinfer.mesh import MeshConfig
    from jaxinfer.models import config_from_dict
    from jaxinfer.plan.auto import local_device_kind
    from jaxinfer.plan.compiled import compile_layout
    from jaxinfer.plan.hardware import device_kind
    from jaxinfer.plan.planner import evaluate
    from jaxinfer.plan.workload import Workload
    from jaxinfer.random_model import BENCH_MOE_100M, DEFAULT

    workload = Workload(args.prompt, args.output, args.concurrency)
    config = EngineConfig.from_cli_args(args)
    kind = device_kind(local_device_kind(jax.devices()[0]), len(jax.devices()))
    models = {"dense": config_from_dict(dict(DEFAULT)), "moe": config_from_dict(dict(BENCH_MOE_100M))}
    rows = []
    for model, meshes in (("dense", args.layouts), ("moe", args.moe_layouts)):
        cfg = models[model]
        single = compile_layout(cfg, MeshConfig(), jnp.float32, config, 1, programs=False)
        for spec in meshes:
            mesh = MeshConfig.parse(spec)
            seqs = -(-workload.concurrency // (mesh.dp * mesh.ep))
            layout_config = dataclasses.replace(config, max_num_seqs=seqs)
            c = evaluate(cfg, mesh, kind, workload, jnp.float32, layout_config, single)
            predicted = {"decode_step_s": c.estimate.decode_step_s, "prefill_step_s": c.estimate.prefill_step_s,
                         "tokens_per_s": c.estimate.tokens_per_s}
            measured = measure(cfg, spec, workload, layout_config)
            rows.append({"model": model, "mesh": str(mesh), "predicted": predicted, "measured": measured,
                         "ratio": {k: measured[k] / predicted[k] for k in predicted}})
    best_predicted = {m: max((r for r in rows if r["model"] == m), key=lambda r: r["predicted"]["tokens_per_s"])
                      for m in models if any(r["model"] == m for r in rows)}
    best_measured = {m: max((r for r in rows if r["model"] == m), key=lambda r: r["measured"]["tokens_per_s"])
                     for m in best_predicted}
    choice = {m: {"chosen": best_predicted[m]["mesh"], "best_measured": best_measured[m]["mesh"],
                  "chosen_over_best": best_predicted[m]["measured"]["tokens_per_s"]
                  / best_measured[m]["measured"]["tokens_per_s"]} for m in best_predicted}
    return {"device": kind.to_json(), "workload": dataclasses.asdict(workload), "platform": jax.devices()[0].platform,
            "rows": rows, "choice": choice}


def readable(r: dict) -> str:
    w = r["workload"]
    lines = [f"{r['device']['source']}; workload prompt={w['prompt']},output={w['output']},"
             f"concurrency={w['concurrency']}",
             f"{'model':<6} {'mesh':<14} {'decode ms pred/meas':>20} {'ratio':>6} {'prefill ms pred/meas':>21} "
             f"{'ratio':>6} {'tok/s pred/meas':>16} {'ratio':>6}"]
    for x in r["rows"]:
        p, m, q = x["predicted"], x["measured"], x["ratio"]
        lines.append(f"{x['model']:<6} {x['mesh']:<14} {p['decode_step_s'] * 1e3:>9.2f} /"
                     f"{m['decode_step_s'] * 1e3:>9.2f} {q['decode_step_s']:>6.2f} {p['prefill_step_s'] * 1e3:>9.1f} /"
                     f"{m['prefill_step_s'] * 1e3:>10.1f} "
                     f"{q['prefill_step_s']:>6.2f} {p['tokens_per_s']:>7.0f} /{m['tokens_per_s']:>7.0f} "
                     f"{q['tokens_per_s']:>6.2f}")
    for model, c in r["choice"].items():
        lines.append(f"{model}: the planner's first choice {c['chosen']} measured {c['chosen_over_best']:.2f}x the "
                     f"best measured ({c['best_measured']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_command(parse_args(argv), run, readable)


if __name__ == "__main__":
    sys.exit(main())
