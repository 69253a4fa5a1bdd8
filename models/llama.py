"""The Llama decoder (Llama 1-3.x, Mistral, Qwen2 with q/k/v biases, Qwen3 with q/k RMSNorm).

Layer weights are stacked along a leading "layers" axis and the forward pass scans over them. The
model names dimensions logically; `layout.constrain` maps them to the mesh through the rules table.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.attention import StepMetadata, paged_attention, rope_and_store
from jaxinfer.checkpoint import ParamSpec
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import PagedKVCache
from jaxinfer.moe import moe
from jaxinfer.sharding import Layout

LAYER = "model.layers.{layer}."


def param_specs(cfg: ModelConfig, kv_repeat: int = 1, vocab_multiple: int = 1) -> dict[str, ParamSpec]:
    """Our layout of every weight, its logical axes, and where it lives in a Hugging Face checkpoint.
    The vocabulary is padded with zero rows to a multiple of `vocab_multiple` (tp) so that it splits evenly."""
    E, M, H, KV, D, L, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                            cfg.head_dim, cfg.num_layers, cfg.vocab_size)
    Vp = -(-V // vocab_multiple) * vocab_multiple
    vocab_pad = (0, V) if Vp != V else None
    KVr = KV * kv_repeat
    attn = LAYER + "self_attn."
    specs = {
        "embed": ParamSpec((Vp, E), ("vocab", "embed"), "model.embed_tokens.weight", pad=vocab_pad),
        "final_norm": ParamSpec((E,), ("embed",), "model.norm.weight"),
        "lm_head": ParamSpec((E, Vp), ("embed", "vocab"),
                             "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight",
                             perm=(1, 0), pad=vocab_pad and (1, V)),
        "attn_norm": ParamSpec((L, E), ("layers", "embed"), LAYER + "input_layernorm.weight"),
        "mlp_norm": ParamSpec((L, E), ("layers", "embed"), LAYER + "post_attention_layernorm.weight"),
        "wq": ParamSpec((L, E, H, D), ("layers", "embed", "heads", "head_dim"), attn + "q_proj.weight",
                        view=((H, D), (E,)), perm=(2, 0, 1)),
        "wk": ParamSpec((L, E, KVr, D), ("layers", "embed", "kv_heads", "head_dim"), attn + "k_proj.weight",
                        view=((KV, D), (E,)), perm=(2, 0, 1), repeat=(1, kv_repeat)),
        "wv": ParamSpec((L, E, KVr, D), ("layers", "embed", "kv_heads", "head_dim"), attn + "v_proj.weight",
                        view=((KV, D), (E,)), perm=(2, 0, 1), repeat=(1, kv_repeat)),
        "wo": ParamSpec((L, H, D, E), ("layers", "heads", "head_dim", "embed"), attn + "o_proj.weight",
                        view=((E,), (H, D)), perm=(1, 2, 0)),
    }
    dense, sparse = cfg.mlp_layers, cfg.moe_layers
    if dense:
        Ld = len(dense)
        specs |= {
            "w_gate": ParamSpec((Ld, E, M), ("layers", "embed", "mlp"), LAYER + "mlp.gate_proj.weight", perm=(1, 0),
                                layer_ids=dense),
            "w_up": ParamSpec((Ld, E, M), ("layers", "embed", "mlp"), LAYER + "mlp.up_proj.weight", perm=(1, 0),
                              layer_ids=dense),
            "w_down": ParamSpec((Ld, M, E), ("layers", "mlp", "embed"), LAYER + "mlp.down_proj.weight",
                                perm=(1, 0), layer_ids=dense),
        }
    if sparse:
        Ls, X, Mx = len(sparse), cfg.num_experts, cfg.moe_intermediate_size
        mixtral = cfg.architecture == "MixtralForCausalLM"
        block = LAYER + ("block_sparse_moe." if mixtral else "mlp.")
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        expert = block + "experts.{expert}.%s.weight"
        specs |= {
            "router": ParamSpec((Ls, E, X), ("layers", "embed", None), block + "gate.weight", perm=(1, 0),
                                layer_ids=sparse),
            "e_gate": ParamSpec((Ls, X, E, Mx), ("layers", "experts", "embed", "mlp"), expert % gate, perm=(1, 0),
                                layer_ids=sparse),
            "e_up": ParamSpec((Ls, X, E, Mx), ("layers", "experts", "embed", "mlp"), expert % up, perm=(1, 0),
                              layer_ids=sparse),
            "e_down": ParamSpec((Ls, X, Mx, E), ("layers", "experts", "mlp", "embed"), expert % down, perm=(1, 0),
                                layer_ids=sparse),
        }
    if cfg.qkv_bias:
        specs["bq"] = ParamSpec((L, H, D), ("layers", "heads", "head_dim"), attn + "q_proj.bias", view=((H, D),))
        for name, hf in (("bk", "k_proj.bias"), ("bv", "v_proj.bias")):
            specs[name] = ParamSpec((L, KVr, D), ("layers", "kv_heads", "head_dim"), attn + hf,
                                    view=((KV, D),), repeat=(0, kv_repeat))
    if cfg.qk_norm:
        specs["q_norm"] = ParamSpec((L, D), ("layers", "head_dim"), attn + "q_norm.weight")
        specs["k_norm"] = ParamSpec((L, D), ("layers", "head_dim"), attn + "k_norm.weight")
    return specs


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


MLP_KEYS, MOE_KEYS, TOP_KEYS = ("w_gate", "w_up", "w_down"), ("router", "e_gate", "e_up", "e_down"), \
    ("embed", "final_norm", "lm_head")


def forward(params: dict, tokens: jax.Array, cache: PagedKVCache, meta: StepMetadata, cfg: ModelConfig,
            layout: Layout) -> tuple[jax.Array, PagedKVCache, dict]:
    """One step over a flat ragged batch. tokens: [R, N] (R data-parallel replicas, N tokens each, at
    meta.positions). Writes their keys/values into the paged cache; returns the final hidden states
    [R, N, E], the cache, and for MoE models the tokens routed to each expert ([MoE layers, R, experts])."""
    act = ("batch", "seq", "embed")
    x = layout.constrain(params["embed"][tokens], act)
    inv_freq = rope_frequencies(cfg)
    valid = jnp.arange(tokens.shape[1])[None] < jnp.take_along_axis(meta.query_start, meta.num_seqs[:, None], 1)

    def attention_block(x, cache, p, i):
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        q = jnp.einsum("bte,ehd->bthd", h, p["wq"])
        k = jnp.einsum("bte,ehd->bthd", h, p["wk"])
        v = jnp.einsum("bte,ehd->bthd", h, p["wv"])
        if cfg.qkv_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        if cfg.qk_norm:
            q, k = rms_norm(q, p["q_norm"], cfg.rms_norm_eps), rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
        q, cache = rope_and_store(q, k, v, cache, i, meta, inv_freq, layout)
        o = paged_attention(q, cache, i, meta, layout)
        x = x + layout.constrain(jnp.einsum("bthd,hde->bte", o, p["wo"]), act)   # all-reduce over tp
        return x, cache, rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)

    def mlp(h, p):
        gated = jax.nn.silu(jnp.einsum("bte,em->btm", h, p["w_gate"])) * jnp.einsum("bte,em->btm", h, p["w_up"])
        return jnp.einsum("btm,me->bte", gated, p["w_down"]), None             # all-reduce over tp follows

    def mixture(h, p):                                                          # all-to-all over ep, twice
        return moe(h, p["router"], p["e_gate"], p["e_up"], p["e_down"], valid, top_k=cfg.experts_per_token,
                   normalize=cfg.norm_topk_prob, layout=layout)

    def layer(carry, xs):
        x, cache = carry
        p, ffn_params, i, sparse = xs
        x, cache, h = attention_block(x, cache, p, i)
        y, counts = (mixture if sparse else mlp)(h, ffn_params)
        return (x + layout.constrain(y, act), cache), counts

    pick = lambda keys, ids=slice(None): {k: params[k][ids] for k in keys if k in params}  # noqa: E731
    attn_keys = [k for k in params if k not in (*TOP_KEYS, *MLP_KEYS, *MOE_KEYS)]
    sparse = bool(cfg.moe_layers)
    if not cfg.moe_layers or not cfg.mlp_layers:   # every layer alike: one scan, compile time flat in depth
        scan_layer = lambda carry, xs: layer(carry, (*xs, sparse))  # noqa: E731
        ffn = pick(MOE_KEYS if sparse else MLP_KEYS)
        (x, cache), counts = jax.lax.scan(scan_layer, (x, cache),
                                          (pick(attn_keys), ffn, jnp.arange(cfg.num_layers)))
        aux = {"expert_counts": counts} if sparse else {}
    else:                                          # dense and MoE layers mixed: unrolled
        counts = []
        for i in range(cfg.num_layers):
            sparse = i in cfg.moe_layers
            own = cfg.moe_layers.index(i) if sparse else cfg.mlp_layers.index(i)
            (x, cache), c = layer((x, cache), (pick(attn_keys, i), pick(MOE_KEYS if sparse else MLP_KEYS, own),
                                               jnp.int32(i), sparse))
            counts += [c] if sparse else []
        aux = {"expert_counts": jnp.stack(counts)}
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cache, aux


def lm_head(params: dict, h: jax.Array) -> jax.Array:
    """float32 logits over the (vocabulary-parallel) LM head."""
    return jnp.einsum("...e,ev->...v", h, params["lm_head"], preferred_element_type=jnp.float32)
