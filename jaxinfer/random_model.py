"""Random-weight models. Hugging Face checkpoints that jaxinfer writes itself (the launcher's embedded
default model and the benchmark's ~100M model), which go through the same loader as any real checkpoint;
and weights drawn directly on the devices (`random_params`, behind `LLM.random`), for shapes too large to
write out, such as LLAMA3_8B."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxinfer.config import cache_dir
from jaxinfer.tokenizer import byte_level_tokenizer_json

# Byte-level vocabulary: <unk>=0, <s>=1, </s>=2, <pad>=3, four reserved specials (so that the vocabulary,
# 264, divides tp=8), then byte b is token 8 + b.
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", *(f"<reserved_{i}>" for i in range(4)))
BYTE_VOCAB = len(SPECIALS) + 256

DEFAULT = {  # the launcher's embedded model: small enough to compile in seconds on CPU, GQA, tp up to 8
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": BYTE_VOCAB,
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "torch_dtype": "float32",
}

BENCH_100M = {**DEFAULT, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000,
              "max_position_embeddings": 2048}

# The sequence-parallel benchmark's model: small weights, a 16k context, so attention dominates long prompts.
BENCH_LONG = {**DEFAULT, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 65536}

# The MoE benchmark's Mixtral-style model: config_from_dict(BENCH_MOE_100M).num_params() == 96,631,296
# (~96.6M total; ~40.0M active per token: 2 of the 8 experts). intermediate_size is the expert width.
BENCH_MOE_100M = {**DEFAULT, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 16000,
                  "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
                  "max_position_embeddings": 2048, "tie_word_embeddings": False}


# The start-up benchmark's larger model: ~1.07B parameters in bfloat16 (2.1 GB on disk), a Llama at TinyLlama's width.
BENCH_1B = {**BENCH_100M, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 20,
            "num_attention_heads": 16, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}


# Llama-3-8B's shape (Meta-Llama-3-8B config.json); served with random weights made on the devices, never on disk.
LLAMA3_8B = {**DEFAULT, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "bos_token_id": 128000,
             "eos_token_id": 128001, "pad_token_id": None, "torch_dtype": "bfloat16"}


def write_random_checkpoint(path: str | Path, config: dict, seed: int = 0) -> Path:
    """A complete checkpoint directory (config, safetensors, byte-level tokenizer) with random weights."""
    import jax

    from jaxinfer.checkpoint import is_spec
    from jaxinfer.models import config_from_dict, model_for

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config_from_dict(config)
    dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(cfg.checkpoint_dtype, np.float32)
    rng = np.random.default_rng(seed)
    tensors = {}
    parts = (p for s in jax.tree.leaves(model_for(cfg).weights(), is_leaf=is_spec) for p in s.parts)
    for spec in parts:
        for name in spec.hf_names():
            if name in tensors:
                continue  # tied embeddings
            if name.endswith("norm.weight"):
                tensors[name] = np.ones(spec.hf_shape, dtype)
            else:
                std = 1.0 / np.sqrt(spec.hf_shape[-1])
                tensors[name] = (rng.standard_normal(spec.hf_shape, np.float32) * std).astype(dtype)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if config["vocab_size"] >= BYTE_VOCAB:
        (path / "tokenizer.json").write_text(byte_level_tokenizer_json(SPECIALS))
        (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                "pad_token": "<pad>", "add_bos_token": True}))
        (path / "chat_template.jinja").write_text(
            "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    return path


def random_params(specs: Any, sharding_of: Callable, dtype, seed: int = 0) -> Any:
    """The pytree of ParamSpec as sharded arrays drawn on the devices: jax.random inside one jit whose
    out_shardings are the specs' shardings, so each device makes its own shards and nothing passes through
    the host. The statistics of write_random_checkpoint: norm weights 1, the rest normal with std
    1 / sqrt(the Hugging Face tensor's last dim); KV heads replicated for tp are copies, and vocabulary
    padding and the padding slots of a pipeline stage are zeros, as the checkpoint loader makes them."""
    import jax

    from jaxinfer.checkpoint import QuantSpec, named_specs, quantize_on_devices

    spec_list = [spec for _, spec in named_specs(specs)]
    drawn = [spec.weight if isinstance(spec, QuantSpec) else spec for spec in spec_list]

    def draw(key):
        return [_random_array(spec, dtype, jax.random.fold_in(key, i)) for i, spec in enumerate(drawn)]

    arrays = jax.jit(draw, out_shardings=[sharding_of(spec.axes) for spec in drawn])(jax.random.key(seed))
    arrays = [quantize_on_devices(a, s, sharding_of) if isinstance(s, QuantSpec) else a  # quantized as they load
              for a, s in zip(arrays, spec_list, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(specs, is_leaf=_is_spec), arrays)


def _is_spec(x: Any) -> bool:
    from jaxinfer.checkpoint import is_spec

    return is_spec(x)


def _random_array(spec, dtype, key):
    """One weight of `spec`'s shape (traced inside jit); a fused one is its parts drawn apart and laid out
    shard by shard, as the loader lays them out."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.checkpoint import FusedSpec, fuse

    if isinstance(spec, FusedSpec):
        return fuse([_random_array(p, dtype, jax.random.fold_in(key, i)) for i, p in enumerate(spec.parts)], spec)

    depth = spec.stack_depth
    shape = list(spec.shape)
    axis, times = spec.repeat
    shape[depth + axis] //= times                       # one copy of each replicated KV head
    if spec.pad is not None:
        shape[depth + spec.pad[0]] = spec.pad[1]        # the real vocabulary
    if spec.hf.endswith("norm.weight"):
        x = jnp.ones(shape, dtype)
    else:
        x = (jax.random.normal(key, shape, dtype) * (1.0 / np.sqrt(spec.hf_shape[-1]))).astype(dtype)
    x = jnp.repeat(x, times, axis=depth + axis)
    if spec.pad is not None:
        widths = [(0, 0)] * x.ndim
        widths[depth + spec.pad[0]] = (0, spec.shape[depth + spec.pad[0]] - spec.pad[1])
        x = jnp.pad(x, widths)
    if spec.layer_ids is not None and None in spec.layer_ids:   # a stage's padding slots hold no layer
        real = jnp.asarray([i is not None for i in spec.layer_ids])
        x = jnp.where(real.reshape(-1, *[1] * (x.ndim - 1)), x, 0)
    return x


def ensure(name: str, config: dict) -> Path:
    """The named random checkpoint under the cache directory, written on first use."""
    path = cache_dir() / name
    stamp = path / "config.json"
    if not stamp.is_file() or json.loads(stamp.read_text()) != config:
        # written aside and renamed into place: processes of one job may race to write it
        tmp = write_random_checkpoint(path.with_name(f".{name}.{os.getpid()}"), config)
        if stamp.is_file() and json.loads(stamp.read_text()) == config:  # another process was first
            shutil.rmtree(tmp, ignore_errors=True)
            return path
        shutil.rmtree(path, ignore_errors=True)                            # a stale copy
        try:
            tmp.rename(path)
        except OSError:  # another process renamed its copy first
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def default_model() -> Path:
    return ensure("default-random-llama", DEFAULT)
