"""The host/device contract: the arrays of one step and their static metadata, and the order of a row's
tokens under sequence parallel. The host (jaxinfer.engine.packer) fills them; the device program
(jaxinfer.device) reads them. Only jax, numpy and the sampling arrays here, so neither side imports the other.

A step is one flat ragged batch per replica: each replica's sequences laid end to end (decode tokens and
prefill chunks alike), one row per replica, padded to bucket shapes. Under sequence parallel (sp ranks)
the token axis is split over the ranks in the load-balanced causal order of ring attention
(jaxinfer.device.attention.ring): the row is cut into 2 x sp chunks and rank r holds chunks r and
2sp-1-r, so every rank has as much causal work as any other. Per-token arrays follow that order
(`ring_order`); per-sequence arrays keep the natural order. A step without the ring (decode only) is
padded to a multiple of sp, not 2 x sp, and keeps its natural order: no rank's tokens attend to another's.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import struct

from jaxinfer.sampling import SamplingArrays


@struct.dataclass
class StepMetadata:
    """Where each token of a flat ragged step belongs. Leading axis: the dp replica (local page ids)."""

    positions: jax.Array    # int32 [R, N] absolute position of each token
    slots: jax.Array        # int32 [R, N] cache slot page * page_size + offset; pages * page_size = padding
    page_table: jax.Array   # int32 [R, S, max_pages]
    seq_lens: jax.Array     # int32 [R, S] KV length of each sequence after this step
    query_start: jax.Array  # int32 [R, S + 1] sequence s owns tokens [query_start[s], query_start[s + 1])
    num_seqs: jax.Array     # int32 [R]
    token_seq: jax.Array    # int32 [R, N] the sequence of each token, -1 for padding
    ring: bool = struct.field(pytree_node=False, default=False)  # sp prefill: fresh K/V travel the ring
    # False only for a ring step in which no sequence has keys cached before it: it reads no pages
    cached: bool = struct.field(pytree_node=False, default=True)


@struct.dataclass
class StepBatch:
    tokens: jax.Array            # int32 [R, N]
    logits_index: jax.Array      # int32 [R, S] the last token of each sequence in this step
    sample_positions: jax.Array  # int32 [R * S] position of the token each sequence samples
    sampling: SamplingArrays     # [R * S]
    meta: StepMetadata
    feed: jax.Array              # int32 [R, N] overlap: the previous step's sampled row index to take the token
                                 # from (its tokens were not on the host when this step was packed), -1 else
    # prompt log-probabilities (SamplingParams.prompt_logprobs): per token, the next prompt token, whose
    # log-probability its logits give, -1 where not asked. None in a step where nobody asked: the tree differs,
    # so only the programs of steps that ask run the head over every token (jaxinfer.device.runner)
    prompt_targets: jax.Array | None = None                             # int32 [R, N], ordered as tokens
    prompt_top: int = struct.field(pytree_node=False, default=0)        # top entries per token: 0 or MAX


def prompt_logprob_width(top: int) -> int:
    """Floats per token of a step's prompt log-probabilities: the next prompt token's log-probability and its
    rank in the vocabulary (1: the most likely), then the ids and log-probabilities of the `top` most likely."""
    return 2 + 2 * top


def ring_order(n: int, sp: int) -> np.ndarray:
    """Token indices of a row of n laid out for sp ranks: rank r's block is chunks r and 2sp-1-r of 2sp. A row
    that 2 x sp does not divide (a decode-only step's, jaxinfer.engine.packer.token_bucket) keeps its order."""
    if sp == 1 or n % (2 * sp):
        return np.arange(n)
    chunks = np.arange(n).reshape(2 * sp, n // (2 * sp))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * sp - 1 - r]]) for r in range(sp)])


@struct.dataclass
class PipelineBatch:
    """One call's inputs: the microbatch entering stage 0, every stage's metadata, and how to sample the
    microbatch at the last stage."""

    tokens: jax.Array            # int32 [R, N] the new microbatch's tokens (stage 0 embeds them)
    feed: jax.Array              # int32 [R, N] the new microbatch's, as in StepBatch (from the previous call)
    meta: StepMetadata           # leaves [P, ...]: stage s's microbatch, which entered s calls ago
    active: jax.Array            # bool [P] whether stage s's microbatch holds any work
    logits_index: jax.Array      # the last stage's microbatch, as in StepBatch
    sample_positions: jax.Array
    sampling: SamplingArrays
    prompt_targets: jax.Array | None = None
    prompt_top: int = struct.field(pytree_node=False, default=0)
