"""LLM: the library API (vLLM's shape). Load a checkpoint onto a mesh, then generate, chat, stream or score.

Every call goes through one EngineLoop (jaxinfer.engine.loop), so an LLM may be shared by threads: their
requests are batched together by the one thread that runs the engine."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.checkpoint import abstract, is_spec, load_params
from jaxinfer.collectives import collective_report
from jaxinfer.config import EngineConfig, ModelConfig, read_json
from jaxinfer.converted import Converted, open_checkpoint
from jaxinfer.device.attention import choose_backend
from jaxinfer.device.compilation_cache import enable_compilation_cache
from jaxinfer.device.layers import Weights, stacks_as_run
from jaxinfer.device.matmul import gemm_layouts, kernel_weights
from jaxinfer.device.pipeline import stage_specs
from jaxinfer.engine.core import Completion, Engine
from jaxinfer.engine.loop import EngineLoop, RequestStream
from jaxinfer.mesh import MeshConfig
from jaxinfer.models import config_from_dict, config_from_dir, model_for
from jaxinfer.plan.auto import AUTO, auto_mesh
from jaxinfer.plan.planner import Plan
from jaxinfer.quant import weight_quantization
from jaxinfer.quant_formats import StoredQuantization, quantized_specs, stored_quantization
from jaxinfer.sampling import SamplingParams
from jaxinfer.sharding import Layout, device_bytes, validate
from jaxinfer.tokenizer import Tokenizer, TokenizerError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
log = logging.getLogger("jaxinfer")

Prompt = str | list[int]


def _engine_config(config: EngineConfig | None, fields: dict) -> EngineConfig:
    """The serving knobs (checked when made); JAX's persistent compilation cache turned on if they say so."""
    config = dataclasses.replace(config or EngineConfig(), **fields)
    if config.compilation_cache:
        enable_compilation_cache()
    return config


def resolve_dtype(dtype: str, cfg: ModelConfig):
    """"auto" serves in the checkpoint's own dtype."""
    name = cfg.checkpoint_dtype if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class LLM:
    """A Hugging Face checkpoint served on a (dp, pp, tp, ep, sp) mesh, e.g. LLM(path, mesh="tp=2"), or on the
    layout planner's choice for the devices at hand, LLM(path, mesh="auto")."""

    def __init__(self, model: str | Path, mesh: str | MeshConfig = "", dtype: str = "auto",
                 engine_config: EngineConfig | None = None, **engine_args):
        """engine_config (or its fields as keyword arguments, e.g. num_pages=64): the serving knobs.
        Everything is checked before any weight is read."""
        engine_config = _engine_config(engine_config, engine_args)
        self.path: Path | None = Path(model)
        config = config_from_dir(self.path)
        stored = stored_quantization(read_json(self.path / "config.json"))
        self._check(config, mesh, dtype, engine_config, stored)
        checkpoint = open_checkpoint(self.path)
        converted = checkpoint.quantization if isinstance(checkpoint, Converted) else None
        for held, how in ((stored and stored.qtype, "stored quantized"), (converted, "converted quantized")):
            if held is not None and engine_config.quantization not in (None, held):
                raise ValueError(f"{self.path} is {how} ({held}): it cannot be served as quantization="
                                 f"{engine_config.quantization!r}; leave quantization unset")
        engine_config = dataclasses.replace(engine_config, quantization=engine_config.quantization or converted)
        try:
            tokenizer: Tokenizer | None = Tokenizer.from_dir(self.path)
        except TokenizerError:
            tokenizer = None  # token-id prompts still work
        self.stored_quantization = stored
        if isinstance(checkpoint, Converted):
            make = lambda specs: checkpoint.restore(self.model, specs, self.layout, self.dtype)  # noqa: E731
        else:
            make = lambda specs: load_params(checkpoint, specs, self.layout.sharding, self.dtype)  # noqa: E731
        self._start(engine_config, tokenizer, make, check=getattr(checkpoint, "check", lambda specs: None),
                    quantize=lambda specs: quantized_specs(specs, engine_config.quantization, stored, checkpoint.dtype))

    @classmethod
    def random(cls, config: ModelConfig | dict, mesh: str | MeshConfig = "", dtype: str = "auto", seed: int = 0,
               engine_config: EngineConfig | None = None, **engine_args) -> LLM:
        """A model of `config`'s shape (a ModelConfig or a config.json dict) with random weights drawn on the
        devices, each array made in its sharding (jaxinfer.random_model.random_params): nothing is written to
        or read from disk, nor held on the host. No tokenizer: prompts are token ids. `path` is None."""
        from jaxinfer.random_model import random_params

        engine_config = _engine_config(engine_config, engine_args)
        llm = cls.__new__(cls)
        llm.path, llm.stored_quantization = None, None
        llm._check(config if isinstance(config, ModelConfig) else config_from_dict(config), mesh, dtype,
                   engine_config)
        llm._start(engine_config, None, lambda specs: random_params(specs, llm.layout.sharding, llm.dtype, seed),
                   quantize=lambda specs: quantized_specs(specs, engine_config.quantization))
        return llm

    def _check(self, config: ModelConfig, mesh: str | MeshConfig, dtype: str, engine_config: EngineConfig,
               stored: StoredQuantization | None = None) -> None:
        """The model against the mesh and the devices, and the serving dtype: before any weight exists. "auto":
        the layout planner's choice for the devices at hand (jaxinfer.plan.auto), its plan kept as `plan`, a
        pre-quantized checkpoint's weights (`stored`) planned as it holds them."""
        self.config = config
        self.dtype = resolve_dtype(dtype, self.config)
        self.plan: Plan | None = None
        if isinstance(mesh, str) and mesh.strip() == AUTO:
            mesh, self.plan = auto_mesh(config, self.dtype, engine_config, stored=stored)
        self.mesh_config = MeshConfig.parse(mesh)
        validate(self.config, self.mesh_config)
        self.mesh_config.check_devices(len(jax.devices()))

    def _start(self, engine_config: EngineConfig, tokenizer: Tokenizer | None,
               make_weights: Callable[[Weights], Weights], check: Callable[[Weights], None] = lambda specs: None,
               quantize: Callable[[Weights], Weights] = lambda specs: specs) -> None:
        """The weights (`make_weights` turns the spec tree into arrays, once `quantize` has chosen the weights
        held quantized and `check` has passed it), the engine and its loop."""
        self.tokenizer = tokenizer
        self.layout = Layout(self.mesh_config.make())
        self.model = model_for(self.config)
        specs = stage_specs(self.model, self.layout)
        stages = self.layout.axis_size("layers")
        specs = stacks_as_run(specs, self.dtype, engine_config.scan_layers, stages)
        specs = quantize(specs)
        check(specs)   # a bad checkpoint is refused before the engine exists
        # The engine is built on the weights' shapes while they load, so the step executables already
        # compiled on this machine are read back meanwhile (jaxinfer.device.compilation_cache).
        backend = choose_backend(engine_config.attention_backend, self.layout.platform, self.config.head_dim,
                                 engine_config.page_size)

        def placed(weights: Weights) -> Weights:   # laid out and typed as the backend's kernels read them
            return kernel_weights(gemm_layouts(weights, self.layout), specs, self.layout, backend)

        shapes = placed(jax.tree.map(lambda s: abstract(s, self.dtype, self.layout.sharding), specs, is_leaf=is_spec))
        with ThreadPoolExecutor(1) as pool:
            weights = pool.submit(lambda: placed(make_weights(specs)))
            self.engine = Engine(self.model, self.layout, shapes, self.dtype, engine_config, self.tokenizer)
            if self.engine.runner.executables_dir is not None and self.engine.stages == 1:
                from jaxinfer.engine.warmup import warmup

                warmup(self.engine, progress=False, stored_only=True)
            self.engine.runner.weights = weights.result()
        self.loop = EngineLoop(self.engine)
        log.info("loaded %s (%s) on mesh %s in %s", self.source, self.config.architecture, self.mesh_config,
                 jnp.dtype(self.dtype).name)

    @property
    def source(self) -> str:
        """Where the weights came from: the checkpoint directory, or "random weights"."""
        return str(self.path) if self.path is not None else "random weights"

    @property
    def weights(self) -> Weights:
        return self.engine.runner.weights

    @property
    def quantization(self) -> dict | None:
        """The matmul weights' quantization: {"weights": "int8" | "fp8", "format": "on load" or the checkpoint's
        quant_method, "activations": the checkpoint's declared scheme}, or None."""
        held = weight_quantization(self.weights)
        if held is None:
            return None
        stored = self.stored_quantization
        return {"weights": held, "format": stored.method if stored else "on load",
                "activations": stored.activations if stored else None}

    def parameter_bytes_per_device(self) -> int:
        """Bytes of weights each device holds (its shards of every array)."""
        return max(device_bytes(self.weights, d) for d in self.layout.mesh.devices.flat)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TokenizerError(f"{self.source} has no tokenizer.json: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int | np.integer) for t in prompt):
            raise TypeError("a prompt is a string or a list of integer token ids")
        return [int(t) for t in prompt]

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """One Completion per prompt; prompts are strings or token-id lists, params one or one per prompt."""
        if isinstance(prompts, str) or (prompts and not isinstance(prompts[0], str | list | tuple)):
            prompts = [prompts]
        if not prompts:
            return []
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
        streams = self.loop.submit_all([self.encode(p) for p in prompts], params)  # checked, then queued together
        return [s.result() for s in streams]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestStream:
        """Iterate for (token id, text delta) as they come; `.result()` for the Completion. Leaving the
        iteration early aborts the request."""
        return self.loop.submit(self.encode(prompt), params or SamplingParams())

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Applies the checkpoint's chat template to one conversation (or a list of them) and generates."""
        if self.tokenizer is None:
            raise TokenizerError(f"{self.source} has no tokenizer.json, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.tokenizer.chat_ids(c) for c in conversations], params)

    def warmup(self, progress: bool = True) -> int:
        """Compile the step buckets a server hits (jaxinfer.engine.warmup) before any request comes; returns how many
        were compiled."""
        from jaxinfer.engine.warmup import warmup

        return warmup(self.engine, progress)

    def collective_report(self) -> dict:
        """Collectives executed by the latest compiled prefill and decode steps (per step, per device)."""
        last = self.engine.runner.last
        return {step: collective_report(last[step].as_text()) for step in ("prefill", "decode") if step in last}

    def close(self) -> None:
        """Abort what is unfinished and stop the engine loop (multi-host: on every process, when process 0
        closes; the others wait for it here). Later calls raise RuntimeError."""
        self.loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def logits(self, token_id_lists: list[list[int]]) -> list[np.ndarray]:
        """Per sequence, float32 logits [T, V] of one full forward pass: the ground-truth hook for tests."""
        return self.loop.score([[int(t) for t in ids] for ids in token_id_lists])
