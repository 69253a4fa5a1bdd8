"""The attention entry point models call. It hides how attention runs (XLA reference here; the Pallas
kernel and ring attention plug in behind the same signature)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array) -> jax.Array:
    """Causal GQA attention of new queries against a cache.

    q: [B, T, H, D] queries at absolute positions q_positions [B, T];
    k, v: [B, S, KV, D] the cache, slot s holding position s. Query t sees slots s <= q_positions[b, t].
    Returns [B, T, H, D] in q's dtype; scores and softmax in float32.
    """
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    qg = q.reshape(B, T, KV, H // KV, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(D)
    visible = jnp.arange(S)[None, None, :] <= q_positions[:, :, None]     # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, D).astype(q.dtype)
