# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A tour of jaxinfer
#
# jaxinfer serves a Hugging Face checkpoint as one JAX program on a mesh of devices with the axes
# `(dp, pp, tp, ep, sp)`. This notebook loads a tiny Llama onto eight fake CPU devices, generates, shows how
# weights, the KV pages and a step's activations are laid out, reads the collectives XLA emitted, checks the
# logits against transformers' reference, asks the layout planner, and serves a research variant of the
# model. It runs top to bottom on a laptop in about a minute.

# %% [markdown]
# **Devices.** On a CPU, XLA can pretend to have several devices; that has to be set before JAX starts.
# On GPUs, leave `XLA_FLAGS` alone: `jax.devices()` lists the real ones, and everything below is the same.

# %%
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax

jax.devices()

# %% [markdown]
# **A model on a mesh, and its first tokens.** `MODEL` is the tiny Llama checkpoint the test suite checks
# numerics against, beside this repository (set `JAXINFER_TOUR_MODEL` to another copy of it): its weights are
# random, so its text is noise, but its logits are exactly transformers'. `mesh="tp=2"` splits every matmul
# over two devices.

# %%
from pathlib import Path

from jaxinfer import LLM, SamplingParams

FIXTURE = Path.cwd().resolve().parents[1] / "shared" / "fixtures" / "hf-tiny" / "llama"
MODEL = Path(os.environ.get("JAXINFER_TOUR_MODEL", FIXTURE))
llm = LLM(MODEL, mesh="tp=2", dtype="float32")
greedy = SamplingParams(max_tokens=12, temperature=0)
print(llm.generate(["The capital of France is"], greedy)[0].text)

# %% [markdown]
# **How a weight is laid out.** The embedding table `[vocab, hidden]` is split over the vocabulary: each of
# the two tensor-parallel devices holds half of the rows. One rules table (`jaxinfer.sharding.RULES`) maps
# every logical axis to mesh axes; the model code only ever names logical axes.

# %%
from jaxinfer.sharding import RULES

embedding = jax.tree.leaves(llm.weights.embed)[0]
print(embedding.shape, embedding.sharding.spec)
jax.debug.visualize_array_sharding(embedding)
{axis: mesh for axis, mesh in RULES.items() if mesh}

# %% [markdown]
# **The KV pages and a step's activations.** The page pool holds keys and values per layer, page and KV
# head; its heads are split like the attention heads. A step's activations `[replicas, tokens, hidden]` are
# replicated over tp between layers (each device has the whole hidden vector after the all-reduce).

# %%
from jaxinfer.device.layers import ACTIVATIONS

pool = jax.tree.leaves(llm.engine.runner.cache)[0]
print("KV pool", pool.shape, pool.sharding.spec, "one device holds", pool.sharding.shard_shape(pool.shape))
activations = llm.layout.sharding(ACTIVATIONS)
print("activations", ACTIVATIONS, "->", activations.spec)
jax.debug.visualize_sharding((16, llm.config.hidden_size), llm.layout.sharding(ACTIVATIONS[1:]))

# %% [markdown]
# **What XLA emitted.** The collective report counts the collectives of the compiled prefill and decode steps
# and their bytes per device, read from the optimized HLO: for tp=2, one all-reduce after attention and one
# after the MLP in every layer.

# %%
from IPython.display import Markdown

report = llm.collective_report()
rows = [f"| {step} | {op} | {c['count']} | {c['bytes']:,} |"
        for step, ops in report.items() for op, c in ops.items() if c["count"]]
Markdown("\n".join(["| step | collective | count | bytes per device |", "| --- | --- | --- | --- |", *rows]))

# %% [markdown]
# **Streaming.** `llm.stream` yields each token as the engine produces it; leaving the loop early aborts the
# request.

# %%
for _, text in llm.stream("Once upon a time", SamplingParams(max_tokens=10, temperature=0)):
    print(repr(text), end=" ")

# %% [markdown]
# **Numerics against transformers.** `llm.logits` scores a prompt (float32 `[tokens, vocab]`). The fixture
# directory holds transformers' logits for the same prompts; the two lie on the diagonal.

# %%
import matplotlib.pyplot as plt
import numpy as np

golden = np.load(MODEL / "golden.npz")   # transformers' input_ids, lengths and logits
prompt = [int(t) for t in golden["input_ids"][0, : golden["lengths"][0]]]
ours, theirs = llm.logits([prompt])[0], golden["logits"][0, : len(prompt)]
print("largest difference", float(np.abs(ours - theirs).max()))
plt.figure(figsize=(4, 4))
plt.scatter(theirs.ravel(), ours.ravel(), s=2)
plt.xlabel("reference logits (transformers)")
plt.ylabel("jaxinfer logits, tp=2")
plt.show()

# %% [markdown]
# **Which layout?** The planner compiles the model's candidate layouts for a device count (here two, no
# weights needed), reads their collectives, and ranks them by a roofline of this machine
# (`python -m jaxinfer.plan` on the command line).

# %%
from jaxinfer.config import EngineConfig
from jaxinfer.plan.hardware import device_kind
from jaxinfer.plan.planner import plan
from jaxinfer.plan.workload import Workload

serving = EngineConfig(max_num_seqs=4)
table = plan(llm.config, 2, device_kind("cpu", 2), Workload.parse("prompt=64,output=16,concurrency=4"),
             np.float32, serving, name=MODEL.name)
print(table.render(MODEL.name, serving))

# %% [markdown]
# **A research variant.** An architecture is a `Model` subclass registered under a config's `architectures`
# name. This one swaps the SwiGLU MLP for a GELU MLP (random weights drawn on the devices, so no checkpoint
# is needed) and runs on tp=2 like any built-in model.

# %%
from typing import Any

import jax.numpy as jnp
from flax import struct

from jaxinfer.checkpoint import ParamSpec
from jaxinfer.config import ModelConfig, decoder_fields
from jaxinfer.models import Llama, register
from jaxinfer.random_model import DEFAULT


@struct.dataclass
class GeluMLP:
    fc_in: Any    # [E, M]
    fc_out: Any   # [M, E]


@register("GeluLlamaForCausalLM")
class GeluLlama(Llama):
    @classmethod
    def config(cls, c):
        return ModelConfig(**decoder_fields(c, sliding_window=False))

    def mlp_weights(self, shards):
        E, M, m = self.cfg.hidden_size, self.cfg.intermediate_size, "model.layers.{layer}.mlp."
        return GeluMLP(ParamSpec((E, M), ("embed", "mlp"), m + "fc_in.weight", perm=(1, 0)),
                       ParamSpec((M, E), ("mlp", "embed"), m + "fc_out.weight", perm=(1, 0)))

    def mlp(self, w, h, ctx):
        hidden = jax.nn.gelu(jnp.einsum("bte,em->btm", h, w.fc_in), approximate=True)
        return ctx.constrain(jnp.einsum("btm,me->bte", hidden, w.fc_out), ACTIVATIONS)


variant = LLM.random({**DEFAULT, "architectures": ["GeluLlamaForCausalLM"]}, mesh="tp=2")
print(variant.generate([[1, 72, 101, 108, 108, 111]], greedy)[0].token_ids)
