"""`python -m jaxinfer.bench.sequence`: sequence parallel at sp = 1, 2, 4, 8: long-prompt prefill, and decode
against context length.

    python -m jaxinfer.bench.sequence                      # random-weight long-context Llama, defaults below
    python -m jaxinfer.bench.sequence --prompt-len 4096 16384 32768 --sp 1 2 4 --json
    python -m jaxinfer.bench.sequence --prompt-len 32768 --sp 1 2 4 --memory-only   # compiles, runs nothing

- Prefill: one prompt of each --prompt-len computed in one step (the whole prompt is one ring), on the
  first sp devices. Time of that step (compilation excluded, measured on a second prompt of the same
  length), tokens/s, eta = T_1 / (sp x T_sp): the fraction of sp devices' time that does useful work
  (below 0.6 the parallelism is not paying), and the memory per rank: the compiled step's temporaries
  (XLA's buffer assignment: the peak of what the step allocates beyond its inputs and outputs) and, where
  the platform reports it (GPU), the device's peak bytes in use. --memory-only compiles each prefill step
  and reports its temporaries and collectives without running it (prompts too long to time on a host).
- Decode: one request at each --contexts length, decode ms per token (decode-only steps, compilation
  excluded), at --decode-sp sizes; KV bytes per device: the pages of the sequence on its busiest rank.
- The collectives of each compiled step: the ring's collective-permutes (prefill), the decode merge's
  all-gather and all-to-all, counts and bytes per device.
On CPU all fake devices share the host's cores, so sp ranks do not compute in parallel as accelerators
would: eta here measures the split's overheads (communication, the ring's merge), not its speed-up. The
attention backend is the same at every sp (the platform's kernels read the pages and, at sp > 1, the
ring's fresh blocks); the prefill rows give the process's CPU time too, every rank's work summed. --pp
puts every layout under a pipeline of that many stages.
"""

from __future__ import annotations

import argparse
import resource
import sys

import numpy as np

from jaxinfer.cli import DTYPES, bench_command

PROMPT_LENS, CONTEXTS = (4096,), (1024, 4096)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.sequence", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the random-weight "
                   "long-context Llama BENCH_LONG, 64k context)")
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4, 8], help="sp sizes for the prefill")
    p.add_argument("--decode-sp", type=int, nargs="+", default=[1, 2, 4], help="sp sizes for decode")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages under every sp (the prompt's time is then "
                   "its steps through every stage)")
    p.add_argument("--prompt-len", type=int, nargs="+", default=list(PROMPT_LENS), help="prefill prompt tokens")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="decode context lengths")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens generated per decode measurement")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="default float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--memory-only", action="store_true",
                   help="compile each prefill step and report its memory and collectives without running it; no decode")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    args.mesh = f"pp={args.pp},sp={max(args.sp + args.decode_sp)}"
    return args


def _llm(path, sp: int, dtype: str, max_tokens: int, pp: int = 1):
    from jaxinfer.llm import LLM

    return LLM(path, mesh=f"pp={pp},sp={sp}", dtype=dtype, max_tokens_per_step=max_tokens, max_num_seqs=1,
               prefix_caching=False)


def generate_once(llm, prompt: list[int], new_tokens: int):
    """The engine's stats of one greedy request of `new_tokens` after `prompt` (prefill and decode seconds)."""
    from jaxinfer.sampling import SamplingParams

    before = llm.engine.stats.copy()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    return llm.engine.stats - before


def _collectives(report: dict) -> dict:
    return {k: v for k, v in report.items() if v["count"] and k in ("collective-permute", "all-gather", "all-to-all")}


def step_memory(llm, phase: str) -> dict:
    """Memory per rank of the last `phase` step: its compiled temporaries, and the device's peak in use where
    the platform keeps count (jax.Device.memory_stats: GPU and TPU, not XLA:CPU)."""
    analysis = llm.engine.runner.last[phase].memory_analysis()
    stats = llm.layout.mesh.devices.flat[0].memory_stats() or {}
    return {"temp_bytes": analysis.temp_size_in_bytes, "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def _cpu_seconds() -> float:
    """This process's CPU time: on fake CPU devices that share the cores, the ranks' work summed (wall time
    cannot show it: the ranks take turns)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def prefill(path, sp: int, prompt_len: int, dtype: str, memory_only: bool = False, pp: int = 1) -> dict:
    llm = _llm(path, sp, dtype, prompt_len, pp)
    if memory_only:   # a fresh prompt's step, as the timed run's second prompt takes it
        from jaxinfer.collectives import collective_report
        from jaxinfer.engine.warmup import compile_shape

        exe = compile_shape(llm.engine, (llm.engine.packer.prefill_sizes[-1], 1, sp > 1, False))
        row = {"sp": sp, "prompt_len": prompt_len, "backend": llm.engine.runner.backend,
               "collectives": _collectives(collective_report(exe.as_text())),
               "temp_bytes": exe.memory_analysis().temp_size_in_bytes, "peak_bytes_in_use": None}
        llm.close()
        return row
    rng = np.random.default_rng(sp)
    prompt = lambda: rng.integers(4, llm.config.vocab_size, prompt_len).tolist()  # noqa: E731
    generate_once(llm, prompt(), 1)                                          # compiles
    cpu = _cpu_seconds()
    s = generate_once(llm, prompt(), 1)
    cpu = _cpu_seconds() - cpu
    row = {"sp": sp, "prompt_len": prompt_len, "seconds": s.prefill_seconds,
           "tokens_per_second": prompt_len / s.prefill_seconds, "cpu_seconds": cpu,
           "backend": llm.engine.runner.backend,
           "collectives": _collectives(llm.collective_report()["prefill"]), **step_memory(llm, "prefill")}
    llm.close()
    return row


def decode(path, sp: int, args: argparse.Namespace, dtype: str) -> list[dict]:
    from jaxinfer.device.kv_cache import page_bytes

    llm = _llm(path, sp, dtype, 512, args.pp)
    engine, rows = llm.engine, []
    P = engine.config.page_size
    per_page = page_bytes(llm.weights.stage_layers, engine.kv_heads // llm.layout.axis_size("kv_heads"), P,
                          llm.config.head_dim, llm.dtype, engine.config.kv_cache_dtype)
    rng = np.random.default_rng(sp)
    for context in args.contexts:
        prompt = lambda c=context: rng.integers(4, llm.config.vocab_size, c).tolist()  # noqa: E731
        generate_once(llm, prompt(), args.decode_tokens)                 # compiles
        s = generate_once(llm, prompt(), args.decode_tokens)
        pages = -(-(context + args.decode_tokens) // P)
        rows.append({"sp": sp, "context": context, "ms_per_token": 1e3 * s.decode_seconds / s.decode_tokens,
                     "kv_bytes_per_device": -(-pages // sp) * per_page,
                     "collectives": _collectives(llm.collective_report()["decode"])})
    return rows


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxinfer import random_model

    path = args.model or random_model.ensure("bench-long-random-llama", random_model.BENCH_LONG)
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    pre = []
    for n in args.prompt_len:
        for sp in args.sp:
            pre.append(prefill(path, sp, n, dtype, args.memory_only, args.pp))
            timed = f"{pre[-1]['seconds']:.2f} s, " if "seconds" in pre[-1] else ""
            print(f"prefill {n} tokens at sp={sp}: {timed}{pre[-1]['temp_bytes'] / 2**20:.1f} MiB of temporaries "
                  "per rank", file=sys.stderr, flush=True)   # a long run shows its progress
    for r in pre:
        first = next(x for x in pre if x["prompt_len"] == r["prompt_len"])
        if "seconds" in r:
            r["eta"] = first["seconds"] / (r["sp"] * r["seconds"])
    dec = [] if args.memory_only else [row for sp in args.decode_sp for row in decode(path, sp, args, dtype)]
    base = {r["context"]: r["ms_per_token"] for r in dec if r["sp"] == args.decode_sp[0]}
    for r in dec:
        r["x_sp1"] = r["ms_per_token"] / base[r["context"]]
    return {"model": str(path), "label": "BENCH_LONG (random weights)" if args.model is None else str(path),
            "dtype": jnp.dtype(dtype).name, "platform": jax.devices()[0].platform, "pp": args.pp, "prefill": pre,
            "decode": dec}


def _fmt(collectives: dict) -> str:
    return ", ".join(f"{k} {v['count']} x / {v['bytes']:,} B" for k, v in collectives.items()) or "none"


def readable(r: dict) -> str:
    lines = [f"model     {r['label']}, {r['dtype']} on {r['platform']}" + (f", pp={r['pp']}" if r["pp"] > 1 else ""),
             "prefill of one prompt in one step; memory per rank: the step's temporaries (GPU: peak in use)",
             f"{'tokens':>6} {'sp':>3} {'seconds':>8} {'cpu s':>7} {'tok/s':>9} {'eta':>6} {'temp MiB':>9}  "
             "collectives per device"]
    for x in r["prefill"]:
        peak = f" (peak {x['peak_bytes_in_use'] / 2**20:,.0f})" if x.get("peak_bytes_in_use") else ""
        timed = (f"{x['seconds']:>8.3f} {x['cpu_seconds']:>7.2f} {x['tokens_per_second']:>9.1f} {x['eta']:>6.2f}"
                 if "seconds" in x else f"{'-':>8} {'-':>7} {'-':>9} {'-':>6}")
        lines.append(f"{x['prompt_len']:>6} {x['sp']:>3} {timed} {x['temp_bytes'] / 2**20:>9.1f}{peak}  "
                     f"{_fmt(x['collectives'])}")
    lines += ["eta = T_1 / (sp x T_sp); below 0.6 the parallelism is not paying; cpu s: the process's CPU time for the "
              "prompt (on CPU devices sharing cores, every rank's work)",
              "decode of one sequence against its context",
              f"{'sp':>3} {'context':>8} {'ms/token':>9} {'x sp=1':>7} {'KV MiB/device':>13}  collectives per device"]
    for x in r["decode"]:
        lines.append(f"{x['sp']:>3} {x['context']:>8} {x['ms_per_token']:>9.2f} {x['x_sp1']:>7.2f} "
                     f"{x['kv_bytes_per_device'] / 2**20:>13.2f}  {_fmt(x['collectives'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_command(parse_args(argv), run, readable)


if __name__ == "__main__":
    sys.exit(main())
