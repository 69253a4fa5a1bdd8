"""SamplingParams (host) and the on-device sampler: greedy, temperature, min-p, top-k, top-p, seed."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FLOAT32_MAX = float(np.finfo(np.float32).max)  # temperature lives in a float32 on the device
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature is greedy, not a division by ~0
SEED_LIMIT = 2**32   # the device holds seeds as uint32
INT32_LIMIT = 2**31  # top_k lives in an int32 on the device; max_tokens and stop token ids are kept below it too
MAX_LOGPROBS = 20    # most alternatives a request may ask for (vLLM's default max_logprobs)


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool | np.bool_)


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool | np.bool_)


def _show(v: object) -> str:
    """Numbers as written (seed=-1, not np.int64(-1)); anything else by repr, so "3" and True stand out."""
    return str(v) if _is_real(v) else repr(v)


@dataclasses.dataclass
class SamplingParams:
    """vLLM's knobs. temperature 0 (or below GREEDY_BELOW) is greedy; top_k 0 or -1, top_p 1 and min_p 0
    switch those filters off. Every field is checked here, so a bad value fails at the caller, not on device."""

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
    logprobs: int | None = None   # per new token: its log-probability and the `logprobs` most likely tokens'
    prompt_logprobs: int | None = None  # per prompt token after the first: the same, from the prompt's own step

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens < INT32_LIMIT:
            raise ValueError(f"max_tokens={_show(self.max_tokens)} must be an integer in [1, 2**31)")
        if (not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0
                or self.temperature > FLOAT32_MAX):
            raise ValueError(f"temperature={_show(self.temperature)} must be a finite number >= 0 (0 means greedy) "
                             f"that a float32 holds (at most {FLOAT32_MAX:.4g})")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={_show(self.top_p)} must be a number in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k < INT32_LIMIT:
            raise ValueError(f"top_k={_show(self.top_k)} must be an integer in [-1, 2**31) (0 or -1 switch it off)")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={_show(self.min_p)} must be a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed={_show(self.seed)} must be None or an integer in [0, 2**32)")
        if any(not isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: stop strings must be str")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={_show(self.logprobs)} must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs={_show(self.prompt_logprobs)} must be None or an integer in "
                             f"[0, {MAX_LOGPROBS}]")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or not 0 <= t < INT32_LIMIT]
        if bad:
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: {bad[:5]!r} must be integers in [0, 2**31)")


@struct.dataclass
class SamplingArrays:
    """One row per batch slot, so one compiled sampler serves any mix of requests."""

    temperature: jax.Array  # float32 [B]
    top_k: jax.Array        # int32 [B], 0 = off
    top_p: jax.Array        # float32 [B]
    min_p: jax.Array        # float32 [B]
    seed: jax.Array         # uint32 [B]
    top_logprobs: int = struct.field(pytree_node=False, default=0)  # alternatives computed per row: 0 or MAX

    @classmethod
    def padding(cls, batch: int) -> SamplingArrays:
        """`batch` greedy rows (on host), for `put` to fill."""
        return cls(temperature=np.zeros(batch, np.float32), top_k=np.zeros(batch, np.int32),
                   top_p=np.ones(batch, np.float32), min_p=np.zeros(batch, np.float32), seed=np.zeros(batch, np.uint32))

    def put(self, row: int, p: SamplingParams, seed: int) -> None:
        """Row `row` draws as `p` says with `seed` (numpy refuses a value its dtype cannot hold: OverflowError)."""
        self.temperature[row], self.top_k[row], self.top_p[row] = p.temperature, max(p.top_k, 0), p.top_p
        self.min_p[row], self.seed[row] = p.min_p, seed

    @classmethod
    def from_params(cls, params: list[SamplingParams], batch: int, seeds: list[int]) -> SamplingArrays:
        s = cls.padding(batch)
        for row, (p, seed) in enumerate(zip(params, seeds, strict=True)):
            s.put(row, p, seed)
        return s.replace(top_logprobs=MAX_LOGPROBS if any(p.logprobs for p in params) else 0)


def sample(logits: jax.Array, s: SamplingArrays, positions: jax.Array,
           row_by_row: bool = False) -> tuple[jax.Array, jax.Array]:
    """Next token per row from float32 logits [B, V], and its log-probabilities: float32 [B, 1 + 2K], the
    drawn token's, then the ids and log-probabilities of the K = s.top_logprobs most likely tokens.

    The key of row b is (seed, position), so a request samples the same tokens whatever else shares its
    batch. Log-probabilities are those of the distribution the token was drawn from: after temperature
    and the filters (a filtered token has -inf), the model's own for a greedy row.

    Greedy rows (padding included) take the argmax; the rows that draw are filtered and drawn in passes
    over them alone: all in one pass, or one row a pass with `row_by_row` (on CPU a row costs the same alone
    as among others, jaxinfer.bench.sampler, so a step's sampling then costs what its drawing rows need,
    not its slots). A pass whose rows have no top-k, top-p or min-p on only divides by the temperature.
    """
    B = logits.shape[0]
    per_pass = 1 if row_by_row else B
    greedy_rows = s.temperature < GREEDY_BELOW
    drawing = B - greedy_rows.sum(dtype=jnp.int32)
    order = jnp.argsort(greedy_rows, stable=True)                   # the rows that draw first

    def one_pass(i, carry):
        x, tokens = carry
        rows = jax.lax.dynamic_slice_in_dim(order, i * per_pass, per_pass)
        live = i * per_pass + jnp.arange(per_pass) < drawing        # a greedy row in a pass keeps its argmax
        part = jax.tree.map(lambda a: jnp.asarray(a)[rows], s)
        temperature = jnp.where(live, part.temperature, 1.0)[:, None]
        filters = live & ((part.top_k > 0) | (part.top_p < 1) | (part.min_p > 0))
        y = jax.lax.cond(filters.any(), lambda: filter_logits(logits[rows], part),
                         lambda: logits[rows] / temperature)
        y = jnp.where(live[:, None], y, logits[rows])
        drawn = jnp.where(live, _draw(y, part, positions[rows]), tokens[rows])
        return x.at[rows].set(y), tokens.at[rows].set(drawn)

    greedy = argmax(logits)
    if row_by_row:
        x, tokens = jax.lax.fori_loop(0, drawing, one_pass, (logits, greedy))
    else:   # a cond, not a loop of one: XLA:CPU made that loop cost 4x the argmax even with no row drawing
        x, tokens = jax.lax.cond(drawing > 0, one_pass, lambda _, carry: carry, 0, (logits, greedy))
    # log-probabilities by log_softmax's arithmetic, of the entries asked for only: no [B, V] array of them
    peak = x.max(-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    log_norm = jnp.log(jnp.exp(x - peak).sum(-1, keepdims=True))
    drawn = jnp.take_along_axis(x, tokens[:, None], axis=-1) - peak - log_norm
    if not s.top_logprobs:
        return tokens, drawn
    top, ids = jax.lax.top_k(x, s.top_logprobs)
    top = top - peak - log_norm
    return tokens, jnp.concatenate([drawn, ids.astype(jnp.float32), top], axis=-1)  # ids < 2**24: exact


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the rows of x [B, V] (the first of ties), as int32: the row's max, then the least
    index that holds it. Two plain reductions that XLA:CPU vectorizes, where jnp.argmax is one reduction
    over (value, index) pairs that it does not: 0.60 -> 0.14 ms for 8 x 32k rows, 9.7 -> 2.0 ms for
    32 x 128k (2 cores). A row holding NaN gives the index of a NaN or of its largest number."""
    top = x.max(-1, keepdims=True)
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.where((x == top) | jnp.isnan(x), ids, x.shape[-1]).min(-1)


def filter_logits(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Logits [B, V] divided by the temperature, with the tokens that cannot be drawn set to -inf.

    The order is vLLM v1's: temperature, then min_p (drop tokens less likely than min_p x the top token's
    probability), then top-k, then top-p on what is left, renormalised; the top token always stays. Each
    filter keeps the tokens at or above a logit threshold, so none needs the vocabulary sorted: top-k's
    threshold is the k-th largest logit and top-p's the lowest logit whose more likely tokens hold less
    than top_p of the mass, each found exactly by a bisection over the logits' 32-bit patterns (32
    passes over the row, a few times cheaper than a sort on CPU; FlashInfer samples without sorting for
    the same reason). Tokens tied at a threshold stay or go together.
    """
    V, rows = logits.shape[-1], logits.shape[0]
    x = logits / jnp.where(s.temperature < GREEDY_BELOW, 1.0, s.temperature)[:, None]
    probs = jax.nn.softmax(x, axis=-1)
    keep = probs >= s.min_p[:, None] * probs.max(-1, keepdims=True)                # min_p
    order = _ordered_bits(x)
    k = jnp.where(s.top_k > 0, s.top_k, V)
    kth = jax.lax.cond((s.top_k > 0).any(), lambda: _largest(lambda t: (order >= t).sum(-1) >= k, rows),
                       lambda: jnp.zeros(rows, jnp.uint32))
    keep &= order >= kth[:, None]                                                     # top-k
    kept = jnp.where(keep, probs, 0.0)
    mass = s.top_p * kept.sum(-1)
    # top-p: keep a token while the mass above it is below top_p (top_p 1 keeps all, despite rounding)
    over = jax.lax.cond((s.top_p < 1).any(),
                        lambda: _largest(lambda t: jnp.where(order > t, kept, 0.0).sum(-1) >= mass, rows),
                        lambda: jnp.zeros(rows, jnp.uint32))
    keep &= (order > over[:, None]) | (s.top_p >= 1)[:, None]
    keep |= x == x.max(-1, keepdims=True)
    return jnp.where(keep, x, -jnp.inf)


def _ordered_bits(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (negative floats' bits flipped), so thresholds are integers."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest(holds: Callable[[jax.Array], jax.Array], rows: int) -> jax.Array:
    """Per row, the largest uint32 t for which holds(t [rows, 1]) -> bool [rows] is true, for a `holds` true
    at 0 and true up to some t, false above it: 32 halvings of [0, 2**32)."""
    def halve(_, bounds):
        lo, hi = bounds                                       # holds(lo); the answer is in [lo, hi]
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2             # the upper middle: no overflow
        ok = holds(mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    bounds = (jnp.zeros(rows, jnp.uint32), jnp.full(rows, 0xFFFFFFFF, jnp.uint32))
    return jax.lax.fori_loop(0, 32, halve, bounds)[0]


def _draw(x: jax.Array, s: SamplingArrays, positions: jax.Array) -> jax.Array:
    """A draw from filtered logits x [B, V] with the key fold_in(key(seed), position) of each row."""
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(s.seed, positions)
    return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
