"""SamplingParams (host) and the on-device sampler: greedy, temperature, top-k, top-p, min-p, seed."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@dataclasses.dataclass
class SamplingParams:
    """vLLM's knobs. temperature 0 is greedy; top_k <= 0, top_p 1 and min_p 0 switch those filters off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


@struct.dataclass
class SamplingArrays:
    """One row per batch slot, so one compiled sampler serves any mix of requests."""

    temperature: jax.Array  # float32 [B]
    top_k: jax.Array        # int32 [B], 0 = off
    top_p: jax.Array        # float32 [B]
    min_p: jax.Array        # float32 [B]
    seed: jax.Array         # uint32 [B]
    all_greedy: jax.Array   # bool [], known on the host: lets the sampler skip the sort without a collective

    @classmethod
    def from_params(cls, params: list[SamplingParams], batch: int, seeds: list[int]) -> SamplingArrays:
        pad = batch - len(params)
        col = lambda f, dt, fill: np.array([f(p) for p in params] + [fill] * pad, dt)  # noqa: E731
        return cls(temperature=col(lambda p: p.temperature, np.float32, 0.0),
                   top_k=col(lambda p: max(p.top_k, 0), np.int32, 0),
                   top_p=col(lambda p: p.top_p, np.float32, 1.0),
                   min_p=col(lambda p: p.min_p, np.float32, 0.0),
                   seed=np.array(list(seeds) + [0] * pad, np.uint32),
                   all_greedy=np.array(all(p.temperature == 0 for p in params)))


def sample(logits: jax.Array, s: SamplingArrays, positions: jax.Array) -> jax.Array:
    """Next token per row from float32 logits [B, V]. The key of row b is (seed, position), so a request
    samples the same tokens whatever else shares its batch."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # The vocabulary sort below costs more than the argmax by far: skip it when every row is greedy.
    return jax.lax.cond(s.all_greedy, lambda: greedy,
                        lambda: jnp.where(s.temperature > 0, _sample_filtered(logits, s, positions), greedy))


def _sample_filtered(logits: jax.Array, s: SamplingArrays, positions: jax.Array) -> jax.Array:
    """Temperature, then top-k, top-p and min-p as one cut-off on the descending sort, then a draw."""
    V = logits.shape[-1]
    x = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    ranked = -jnp.sort(-x, axis=-1)                                     # descending
    probs = jax.nn.softmax(ranked, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = rank < jnp.where(s.top_k > 0, s.top_k, V)[:, None]
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / kept.sum(-1, keepdims=True)
    keep &= (jnp.cumsum(kept, axis=-1) - kept) < s.top_p[:, None]      # nucleus: mass before this token
    keep &= probs >= s.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    threshold = jnp.take_along_axis(ranked, keep.sum(-1, keepdims=True) - 1, axis=-1)
    x = jnp.where(x >= threshold, x, -jnp.inf)
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(s.seed, positions)
    return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
