"""The Llama decoder family: Llama 1-3.x, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm), and the
mixture-of-experts Mixtral and Qwen3-MoE. One block, as in the papers:

    h = x + Attention(RMSNorm(x)),   out = h + FFN(RMSNorm(h)),   FFN = SwiGLU MLP or a mixture of them

Dimensions are named logically (`ACTIVATIONS`, the specs' axes); jaxinfer.sharding maps them onto the
mesh, and the StepContext runs attention and the experts wherever they live. The projections that read
the same input are fused, one matmul each: q/k/v and gate/up, stored shard by shard (FusedSpec) so that
every device's slice holds its own columns of each part; the model splits the result by the parts' widths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.checkpoint import FusedSpec, ParamSpec, unfuse
from jaxinfer.config import ConfigError, ModelConfig, decoder_fields
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.device.layers import ACTIVATIONS, StepContext, Weights, stack_layers
from jaxinfer.models.base import Model, register

LAYER = "model.layers.{layer}."
W = Any  # a jax.Array (or jaxinfer.quant.QuantArray) once loaded, its spec before; None where there is none
# G below: the column shards the fused weights are stored in (the tensor-parallel degree; 1 on one device).
# Every projection is stored [in, out] (the checkpoint's [out, in] transposed at load), the contraction on
# its first axis: from [out, in] XLA:CPU's matmul repacks the whole weight on every call, which at 8 rows
# took ~45% of a decode step's CPU time (125M model: 8-row decode 223-242 -> 275-277 tok/s, 1 row alike;
# jaxinfer.bench.decode). GPUs read either order alike.


@struct.dataclass
class Attention:
    qkv: W              # [E, G, (H + 2 KV) / G, D]: block g = [q, k, v heads of shard g]
    o: W                # [H, D, E]
    qkv_bias: W = None  # [G, (H + 2 KV) / G, D]
    o_bias: W = None    # [E]
    q_norm: W = None    # [D] (Qwen3)
    k_norm: W = None    # [D]


@struct.dataclass
class MLP:
    gate_up: W          # [E, G, 2 M / G]: block g = [gate, up columns of shard g]
    down: W             # [M, E]
    gate_up_bias: W = None  # [G, 2 M / G]
    down_bias: W = None     # [E]


@struct.dataclass
class Experts:
    router: W           # [E, X]
    gate_up: W          # [X, E, G, 2 M / G]: block g = [gate, up columns of shard g]
    down: W             # [X, M, E]


@struct.dataclass
class Layer:
    attn_norm: W        # [E]
    attn: Attention
    mlp_norm: W         # [E]
    mlp: MLP | Experts


@struct.dataclass
class Embedding:
    table: W            # [V, E]


@struct.dataclass
class Head:
    norm: W             # [E]
    lm_head: W          # [E, V]


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * x32.astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies, with Llama 3 ("llama3") or linear position-interpolation scaling."""
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    rope = cfg.rope
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        inv = inv / rope["factor"]
    elif kind == "llama3":
        factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = jnp.where(medium, smoothed, scaled)
    return inv


def _num_experts(c: dict[str, Any]) -> int:
    """Mixtral's num_local_experts or Qwen3-MoE's num_experts (checkpoints use either)."""
    n = c.get("num_local_experts") or c.get("num_experts")
    if not n:
        raise KeyError("num_experts")
    return n


def _optional(present: bool, spec: ParamSpec) -> ParamSpec | None:
    return spec if present else None


@register("LlamaForCausalLM")
class Llama(Model):
    """Llama; `attention_bias` adds biases to q/k/v/o, `mlp_bias` to gate/up/down (as transformers does)."""

    sliding_window_by_default = False  # see config.decoder_fields
    experts_prefix = "mlp."            # where an MoE block's tensors live under model.layers.{layer}.
    expert_names = ("gate_proj", "up_proj", "down_proj")

    @classmethod
    def config(cls, c: dict[str, Any]) -> ModelConfig:
        bias = bool(c.get("attention_bias", False))
        return ModelConfig(**cls._fields(c), qkv_bias=bias, o_bias=bias, mlp_bias=bool(c.get("mlp_bias", False)))

    @classmethod
    def _fields(cls, c: dict[str, Any]) -> dict[str, Any]:
        fields = decoder_fields(c, sliding_window=cls.sliding_window_by_default)
        if fields["hidden_act"] not in ("silu", "swish"):
            raise ConfigError(f"hidden_act={fields['hidden_act']!r}: this architecture's MLP is SwiGLU (silu); "
                              f"register a Model subclass for another activation (jaxinfer.models.register)")
        return fields

    # ---- weights ----------------------------------------------------------------------------------
    def weights(self, *, kv_repeat: int = 1, vocab_multiple: int = 1, column_shards: int = 1) -> Weights:
        cfg = self.cfg
        E, V = cfg.hidden_size, cfg.vocab_size
        Vp = -(-V // vocab_multiple) * vocab_multiple
        pad = (0, V) if Vp != V else None
        embed = Embedding(ParamSpec((Vp, E), ("vocab", "embed"), "model.embed_tokens.weight", pad=pad))
        head = Head(norm=ParamSpec((E,), ("embed",), "model.norm.weight"),
                    lm_head=ParamSpec((E, Vp), ("embed", "vocab"),
                                      "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight",
                                      perm=(1, 0), pad=(1, V) if Vp != V else None, contract=1))
        sparse = set(cfg.moe_layers)
        layers = stack_layers(cfg.num_layers, lambda i: i in sparse,
                              lambda moe: self.layer_weights(moe, kv_repeat=kv_repeat, shards=column_shards))
        return Weights(embed=embed, layers=layers, head=head)

    def layer_weights(self, moe: bool, *, kv_repeat: int, shards: int) -> Layer:
        E = self.cfg.hidden_size
        norm = lambda name: ParamSpec((E,), ("embed",), LAYER + name)  # noqa: E731
        return Layer(attn_norm=norm("input_layernorm.weight"), attn=self.attention_weights(kv_repeat, shards),
                     mlp_norm=norm("post_attention_layernorm.weight"),
                     mlp=self.expert_weights(shards) if moe else self.mlp_weights(shards))

    def attention_weights(self, kv_repeat: int, shards: int) -> Attention:
        cfg = self.cfg
        E, H, KV, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        KVr, a = KV * kv_repeat, LAYER + "self_attn."
        kv = lambda name: ParamSpec((E, KVr, D), ("embed", "kv_heads", "head_dim"), a + name,  # noqa: E731
                                    view=((KV, D), (E,)), perm=(2, 0, 1), repeat=(1, kv_repeat), contract=1)
        kv_bias = lambda name: ParamSpec((KVr, D), ("kv_heads", "head_dim"), a + name,  # noqa: E731
                                         view=((KV, D),), repeat=(0, kv_repeat))
        q = ParamSpec((E, H, D), ("embed", "heads", "head_dim"), a + "q_proj.weight", view=((H, D), (E,)),
                      perm=(2, 0, 1), contract=1)
        q_bias = ParamSpec((H, D), ("heads", "head_dim"), a + "q_proj.bias", view=((H, D),))
        by_heads = lambda *parts, axis: FusedSpec(parts, axis=axis, shards=shards)  # noqa: E731  (the heads axis)
        return Attention(
            qkv=by_heads(q, kv("k_proj.weight"), kv("v_proj.weight"), axis=-2),
            o=ParamSpec((H, D, E), ("heads", "head_dim", "embed"), a + "o_proj.weight", view=((E,), (H, D)),
                        perm=(1, 2, 0), contract=2),
            qkv_bias=_optional(cfg.qkv_bias, by_heads(q_bias, kv_bias("k_proj.bias"), kv_bias("v_proj.bias"),
                                                      axis=-2)),
            o_bias=_optional(cfg.o_bias, ParamSpec((E,), ("embed",), a + "o_proj.bias")),
            q_norm=_optional(cfg.qk_norm, ParamSpec((D,), ("head_dim",), a + "q_norm.weight")),
            k_norm=_optional(cfg.qk_norm, ParamSpec((D,), ("head_dim",), a + "k_norm.weight")),
        )

    def mlp_weights(self, shards: int) -> MLP:
        cfg, m = self.cfg, LAYER + "mlp."
        E, M = cfg.hidden_size, cfg.intermediate_size
        column = lambda name: ParamSpec((E, M), ("embed", "mlp"), m + name, perm=(1, 0), contract=1)  # noqa: E731
        bias = lambda name: ParamSpec((M,), ("mlp",), m + name)  # noqa: E731
        return MLP(gate_up=FusedSpec((column("gate_proj.weight"), column("up_proj.weight")), shards=shards),
                   down=ParamSpec((M, E), ("mlp", "embed"), m + "down_proj.weight", perm=(1, 0), contract=1),
                   gate_up_bias=_optional(cfg.mlp_bias, FusedSpec((bias("gate_proj.bias"), bias("up_proj.bias")),
                                                                  shards=shards)),
                   down_bias=_optional(cfg.mlp_bias, ParamSpec((E,), ("embed",), m + "down_proj.bias")))

    def expert_weights(self, shards: int) -> Experts:
        cfg = self.cfg
        E, X, M = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        block = LAYER + self.experts_prefix
        expert = lambda name, shape, axes: ParamSpec(  # noqa: E731
            (X, *shape), ("experts", *axes), block + "experts.{expert}." + name + ".weight", perm=(1, 0),
            contract=1)
        gate, up, down = self.expert_names
        column = lambda name: expert(name, (E, M), ("embed", "mlp"))  # noqa: E731
        return Experts(router=ParamSpec((E, X), ("embed", None), block + "gate.weight", perm=(1, 0)),
                       gate_up=FusedSpec((column(gate), column(up)), shards=shards),
                       down=expert(down, (M, E), ("mlp", "embed")))

    # ---- stage functions ---------------------------------------------------------------------------
    def embed(self, w: Embedding, tokens: jax.Array, ctx: StepContext) -> jax.Array:
        return ctx.embed(w.table, tokens)   # vocabulary-parallel: an all-reduce over tp

    def layer(self, w: Layer, x: jax.Array, cache: PagedKVCache, layer: jax.Array,
              ctx: StepContext) -> tuple[jax.Array, PagedKVCache, jax.Array | None]:
        eps = self.cfg.rms_norm_eps
        o, cache = self.attention(w.attn, rms_norm(x, w.attn_norm, eps), cache, layer, ctx)
        x = x + o
        y, counts = self.ffn(w.mlp, rms_norm(x, w.mlp_norm, eps), ctx)
        return x + y, cache, counts

    def head(self, w: Head, h: jax.Array, ctx: StepContext) -> jax.Array:
        h = rms_norm(h, w.norm, self.cfg.rms_norm_eps)
        return ctx.matmul(h, w.lm_head, out_dtype=jnp.float32)

    # ---- the block's parts -------------------------------------------------------------------------
    def attention(self, w: Attention, h: jax.Array, cache: PagedKVCache, layer: jax.Array,
                  ctx: StepContext) -> tuple[jax.Array, PagedKVCache]:
        eps = self.cfg.rms_norm_eps
        qkv = ctx.matmul(h, w.qkv)                                              # one matmul for q, k and v
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        groups, cols = w.qkv.shape[1:3]
        q_cols = self.cfg.num_heads // groups                                   # the same in every block
        q, k, v = unfuse(qkv, (q_cols, (cols - q_cols) // 2, (cols - q_cols) // 2), axis=2)
        if w.q_norm is not None:
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        o, cache = ctx.attention(q, k, v, cache, layer, rope_frequencies(self.cfg))
        out = ctx.constrain(ctx.matmul(o, w.o, contract=2), ACTIVATIONS)     # row-parallel: all-reduce over tp
        return (out if w.o_bias is None else out + w.o_bias), cache

    def ffn(self, w: MLP | Experts, h: jax.Array, ctx: StepContext) -> tuple[jax.Array, jax.Array | None]:
        if isinstance(w, Experts):                                               # all-to-all over ep, twice
            y, counts = ctx.moe(h, w.router, w.gate_up, w.down, top_k=self.cfg.experts_per_token,
                                normalize=self.cfg.norm_topk_prob)
            return ctx.constrain(y, ACTIVATIONS), counts
        return self.mlp(w, h, ctx), None

    def mlp(self, w: MLP, h: jax.Array, ctx: StepContext) -> jax.Array:
        gate_up = ctx.matmul(h, w.gate_up)                                      # one matmul for gate and up
        if w.gate_up_bias is not None:
            gate_up = gate_up + w.gate_up_bias
        half = gate_up.shape[-1] // 2
        gate, up = unfuse(gate_up, (half, half), axis=2)
        out = ctx.constrain(ctx.matmul(jax.nn.silu(gate) * up, w.down), ACTIVATIONS)  # all-reduce over tp
        return out if w.down_bias is None else out + w.down_bias


@register("MistralForCausalLM")
class Mistral(Llama):
    """The Llama block without biases; the context is capped at `sliding_window` where one is set."""

    sliding_window_by_default = True

    @classmethod
    def config(cls, c: dict[str, Any]) -> ModelConfig:
        return ModelConfig(**cls._fields(c))


@register("Qwen2ForCausalLM")
class Qwen2(Llama):
    """Biases on q/k/v (never on o or the MLP)."""

    @classmethod
    def config(cls, c: dict[str, Any]) -> ModelConfig:
        return ModelConfig(**cls._fields(c), qkv_bias=True)


@register("Qwen3ForCausalLM")
class Qwen3(Llama):
    """RMSNorm on each q and k head before RoPE; `attention_bias` on q/k/v/o; explicit head_dim."""

    @classmethod
    def config(cls, c: dict[str, Any]) -> ModelConfig:
        bias = bool(c.get("attention_bias", False))
        return ModelConfig(**cls._fields(c), qkv_bias=bias, o_bias=bias, qk_norm=True)


@register("MixtralForCausalLM")
class Mixtral(Mistral):
    """Every layer a mixture: softmax over the experts, top-k, renormalised over the chosen ones."""

    experts_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")

    @classmethod
    def config(cls, c: dict[str, Any]) -> ModelConfig:
        return dataclasses.replace(super().config(c), num_experts=_num_experts(c),
                                   experts_per_token=c["num_experts_per_tok"],
                                   moe_intermediate_size=c["intermediate_size"], norm_topk_prob=True)


@register("Qwen3MoeForCausalLM")
class Qwen3Moe(Qwen3):
    """Qwen3 attention; softmax over all experts then top-k, `norm_topk_prob` on or off; dense layers where
    `mlp_only_layers` or `decoder_sparse_step` say."""

    @classmethod
    def config(cls, c: dict[str, Any]) -> ModelConfig:
        step = c.get("decoder_sparse_step") or 1
        dense = {i for i in range(c["num_hidden_layers"]) if (i + 1) % step or i in (c.get("mlp_only_layers") or [])}
        return dataclasses.replace(super().config(c), num_experts=_num_experts(c),
                                   experts_per_token=c["num_experts_per_tok"],
                                   moe_intermediate_size=c.get("moe_intermediate_size") or c["intermediate_size"],
                                   norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                                   dense_layers=tuple(sorted(dense)))
