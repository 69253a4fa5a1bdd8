"""Host packing: the replicas' scheduled work as one flat ragged batch of bucketed arrays.

Each replica's sequences are laid end to end (decode tokens and prefill chunks alike), one row per
replica, padded to shared bucket shapes so that a steady workload compiles nothing new:
- tokens per replica: a power of two;
- sequences per replica: a power of two;
- pages per sequence in the page table: a power of two.
Padding tokens write their K/V to a sentinel slot (one past the pool) that the cache write drops.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import struct

from jaxinfer.sampling import SamplingArrays, SamplingParams
from jaxinfer.scheduler import SchedulerOutput

GREEDY = SamplingParams(temperature=0)


@struct.dataclass
class StepMetadata:
    """Where each token of a flat ragged step belongs. Leading axis: the dp replica (local page ids)."""

    positions: jax.Array    # int32 [R, N] absolute position of each token
    slots: jax.Array        # int32 [R, N] cache slot page * page_size + offset; pages * page_size = padding
    page_table: jax.Array   # int32 [R, S, max_pages]
    seq_lens: jax.Array     # int32 [R, S] KV length of each sequence after this step
    query_start: jax.Array  # int32 [R, S + 1] sequence s owns tokens [query_start[s], query_start[s + 1])
    num_seqs: jax.Array     # int32 [R]


@struct.dataclass
class StepBatch:
    tokens: jax.Array            # int32 [R, N]
    logits_index: jax.Array      # int32 [R, S] the last token of each sequence in this step
    sample_positions: jax.Array  # int32 [R * S] position of the token each sequence samples
    sampling: SamplingArrays     # [R * S]
    meta: StepMetadata


def bucket(n: int, minimum: int = 1, multiple: int = 1) -> int:
    """n rounded up to a power of two (at least `minimum`), then to a multiple of `multiple`."""
    size = max(minimum, 1 << (max(n, 1) - 1).bit_length())
    return -(-size // multiple) * multiple


def bucket_shape(outputs: list[SchedulerOutput]) -> tuple[int, int, int]:
    """(tokens, sequences, pages per sequence) per replica, each rounded up to its bucket."""
    return (bucket(max(o.num_tokens for o in outputs)), bucket(max(len(o.sequences) for o in outputs)),
            bucket(max((len(s.pages) for o in outputs for s in o.sequences), default=1)))


def pack(outputs: list[SchedulerOutput], page_size: int, pool_pages: int,
         shape: tuple[int, int, int] | None = None) -> StepBatch:
    """One row per replica (outputs[i] is replica i's work), padded to shared bucket shapes (`shape`, at
    least bucket_shape(outputs), when several batches must share one)."""
    P, R = page_size, len(outputs)
    N, S, max_pages = shape or bucket_shape(outputs)
    tokens, positions = np.zeros((R, N), np.int32), np.zeros((R, N), np.int32)
    slots = np.full((R, N), pool_pages * P, np.int32)
    page_table = np.zeros((R, S, max_pages), np.int32)
    seq_lens, logits_index = np.zeros((R, S), np.int32), np.zeros((R, S), np.int32)
    query_start, num_seqs = np.zeros((R, S + 1), np.int32), np.zeros(R, np.int32)
    params, seeds = [GREEDY] * (R * S), [0] * (R * S)
    for i, out in enumerate(outputs):
        t = 0
        for s, seq in enumerate(out.sequences):
            n = len(seq.token_ids)
            pos = np.arange(seq.start, seq.end)
            tokens[i, t: t + n] = seq.token_ids
            positions[i, t: t + n] = pos
            slots[i, t: t + n] = np.asarray(seq.pages)[pos // P] * P + pos % P
            page_table[i, s, : len(seq.pages)] = seq.pages
            seq_lens[i, s] = seq.end
            logits_index[i, s] = t + n - 1
            query_start[i, s + 1] = t + n
            params[i * S + s], seeds[i * S + s] = seq.params, seq.seed
            t += n
        query_start[i, len(out.sequences) + 1:] = t
        num_seqs[i] = len(out.sequences)
    meta = StepMetadata(positions, slots, page_table, seq_lens, query_start, num_seqs)
    return StepBatch(tokens, logits_index, seq_lens.reshape(-1), SamplingArrays.from_params(params, R * S, seeds), meta)
