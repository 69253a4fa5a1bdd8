"""`python -m jaxinfer.launch`: serve one prompt (or chat turn, or a batch file) on a mesh and report what it cost.

    python -m jaxinfer.launch --mesh tp=8                 # embedded random-weight model, fake CPU devices
    python -m jaxinfer.launch --mesh dp=2,tp=4 --model /ckpt/Llama-3.1-8B-Instruct --prompt "Hello"
    python -m jaxinfer.launch --mesh llama-70b-8gpu --model /ckpt/Llama-3.3-70B --chat "Hi" --json
    python -m jaxinfer.launch --model /ckpt/Qwen3-8B --input requests.jsonl --output results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from jaxinfer.cli import add_model_args, load, prepare, served_model_name
from jaxinfer.sampling import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.launch", description=__doc__.split("\n")[0])
    add_model_args(p)
    text = p.add_mutually_exclusive_group()
    text.add_argument("--prompt", default=None, help="raw prompt text")
    text.add_argument("--chat", default=None, help="one user message, wrapped in the checkpoint's chat template")
    text.add_argument("--input", default=None, help="a batch file: one OpenAI batch request per line (JSONL)")
    p.add_argument("--output", default=None, help="with --input: where to write one result line per request")
    p.add_argument("--resume", action="store_true", help="with --input: skip the requests whose custom_id already "
                   "has a result line in --output, and append the others' (a job that was interrupted)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--report-collectives", action="store_true",
                   help="print the collectives of the compiled prefill and decode steps")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    if (args.input is None) != (args.output is None):
        p.error("--input and --output go together")
    if args.resume and args.input is None:
        p.error("--resume needs --input and --output")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        job, mesh, engine_config = prepare(args)
    except ValueError as e:  # MeshError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.input is not None and job.process_id == 0:
        if not os.path.isfile(args.input):
            print(f"error: no batch file at {args.input}", file=sys.stderr)
            return 2
        from jaxinfer.serve.batch_job import read_requests
        try:
            read_requests(args.input)  # a repeated custom_id is refused before the model loads
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    import jax

    from jaxinfer.collectives import format_report

    try:
        llm, random_weights = load(args, mesh, engine_config)
        if args.input is not None:
            return batch(args, llm)
        if args.chat is not None:
            out = llm.chat([{"role": "user", "content": args.chat}], params)[0]
        else:
            out = llm.generate([args.prompt if args.prompt is not None else "The capital of France is"], params)[0]
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm.close()  # multi-host: process 0 releases the others' loops
    result = summary(llm, out, random_weights)
    if args.report_collectives or args.json:
        result["collectives"] = llm.collective_report()
    if jax.process_index() != 0:  # every process computed the same; one speaks
        return 0
    if args.json:
        print(json.dumps(result))
        return 0
    print(readable(result))
    if args.report_collectives:
        print(format_report(result["collectives"]))
    return 0


def batch(args: argparse.Namespace, llm) -> int:
    """Runs the batch file (process 0; the others follow its loop). 0 when every line is written; 128 + the
    signal's number when SIGINT or SIGTERM stopped it, after saying how to finish it."""
    from jaxinfer.serve.batch_job import BatchInterrupted, run_batch_file

    status = 0
    if llm.loop.leader:
        try:
            counts = run_batch_file(llm, served_model_name(args), args.input, args.output, resume=args.resume)
        except BatchInterrupted as e:
            counts, status = e.counts | {"interrupted": signal.Signals(e.signum).name}, 128 + e.signum
            todo, written = counts["requests"] - counts.get("skipped", 0), counts["succeeded"] + counts["failed"]
            print(f"{e}: {written} of {todo} requests answered, their lines written to {args.output}; run the "
                  f"same command with --resume to answer the other {todo - written}", file=sys.stderr)
        if args.json:
            print(json.dumps(counts))
        elif not status:
            skipped = f", {counts['skipped']} skipped as already done" if "skipped" in counts else ""
            print(f"{counts['requests']} requests: {counts['succeeded']} succeeded, {counts['failed']} failed"
                  f"{skipped}; results in {args.output}")
    llm.close()  # multi-host: the followers served the batch with process 0 until here
    return status


def summary(llm, out, random_weights: bool) -> dict:
    s = llm.engine.stats
    return {
        "model": str(llm.path) + (" (random weights)" if random_weights else ""),
        "random_weights": random_weights,
        "architecture": llm.config.architecture,
        "mesh": {a: getattr(llm.mesh_config, a) for a in ("dp", "pp", "tp", "ep", "sp")},
        "devices": llm.mesh_config.size,
        "platform": llm.layout.platform,
        "dtype": llm.engine.dtype.__name__ if hasattr(llm.engine.dtype, "__name__") else str(llm.engine.dtype),
        "parameter_bytes_per_device": llm.parameter_bytes_per_device(),
        "quantization": llm.quantization,                       # None, or the matmul weights' int8/fp8 and source
        "attention_backend": llm.engine.runner.backend,
        "kv_pages_per_replica": llm.engine.pages_per_replica,
        "page_size": llm.engine.config.page_size,
        "kv_cache_dtype": llm.engine.kv_cache_dtype,             # what the pages hold (int8/fp8: with scales)
        "kv_bytes_per_token_per_device": llm.engine.kv_bytes_per_token,
        "prompt_tokens": len(out.prompt_token_ids),
        "output_token_ids": out.token_ids,
        "output_text": out.text,
        "finish_reason": out.finish_reason,
        "prefill_seconds": s.prefill_seconds,
        "prefill_tokens_per_second": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else 0.0,
        "decode_seconds": s.decode_seconds,
        "decode_tokens_per_second": s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0,
        "compile_seconds": s.compile_seconds,
        "pipeline_utilisation": s.utilisation,   # busy stage-steps / stage-steps (one request: 1 / pp)
        "expert_load": llm.engine.expert_load.report(),   # MoE models: tokens per expert and max/mean, per layer
    }


def readable(r: dict) -> str:
    mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "single device"
    return "\n".join([
        f"model   {r['model']} [{r['architecture']}, {r['dtype']}]",
        f"mesh    {mesh} on {r['devices']} {r['platform']} device(s); "
        f"{r['parameter_bytes_per_device'] / 2**20:.1f} MiB of weights per device"
        + (f" ({r['quantization']['weights']} matmuls, {r['quantization']['format']})" if r["quantization"] else ""),
        f"cache   {r['kv_pages_per_replica']} pages of {r['page_size']} tokens per replica, "
        f"{r['kv_cache_dtype']} ({r['kv_bytes_per_token_per_device']} bytes a token per device); "
        f"attention backend {r['attention_backend']}",
        f"prompt  {r['prompt_tokens']} tokens",
        f"output  {r['output_text']!r}",
        f"        {len(r['output_token_ids'])} tokens, finish_reason={r['finish_reason']}",
        f"prefill {r['prefill_seconds']:.3f} s ({r['prefill_tokens_per_second']:.1f} tokens/s)",
        f"decode  {r['decode_seconds']:.3f} s ({r['decode_tokens_per_second']:.1f} tokens/s)",
        f"compile {r['compile_seconds']:.1f} s (not counted above)",
        *([f"stages  utilisation {r['pipeline_utilisation']:.3f} (busy stage-steps / stage-steps)"]
          if r["mesh"]["pp"] > 1 else []),
        *([f"experts imbalance (max/mean tokens per expert) by MoE layer: "
           f"{', '.join(f'{x:.2f}' for x in r['expert_load']['total']['imbalance'])}"] if r["expert_load"] else []),
    ])


if __name__ == "__main__":
    sys.exit(main())
