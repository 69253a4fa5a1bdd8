"""Host packing: the replicas' scheduled work as one flat ragged batch of bucketed arrays.

Each replica's sequences are laid end to end (decode tokens and prefill chunks alike), one row per
replica, padded to shared bucket shapes so that a steady workload compiles nothing new:
- tokens per replica: a power of two (steps with prompt tokens: one of prefill_sizes, chosen by the engine);
- sequences per replica: a power of two;
- pages per sequence in the page table: one width per engine (table_width), whatever the step.
Padding tokens write their K/V to a sentinel slot (one past the pool) that the cache write drops.

Under sequence parallel each row is laid out in ring order (jaxinfer.step.ring_order).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxinfer.engine.scheduler import SchedulerOutput
from jaxinfer.sampling import MAX_LOGPROBS, SamplingArrays, SamplingParams
from jaxinfer.step import PipelineBatch, StepBatch, StepMetadata, ring_order

GREEDY = SamplingParams(temperature=0)


def bucket(n: int, minimum: int = 1, multiple: int = 1) -> int:
    """n rounded up to a power of two (at least `minimum`), then to a multiple of `multiple`."""
    size = max(minimum, 1 << (max(n, 1) - 1).bit_length())
    return -(-size // multiple) * multiple


def token_bucket(n: int, sp: int = 1, ring: bool = False) -> int:
    """n tokens per replica rounded up to a power of two; under sp to a multiple of sp (a share per rank), and
    of the ring's 2 x sp chunks for a step with prompt tokens (`ring`)."""
    return bucket(n, multiple=sp * (2 if ring else 1))


def bucket_shape(outputs: list[SchedulerOutput], sp: int = 1) -> tuple[int, int]:
    """(tokens, sequences) per replica, each rounded up to its bucket (tokens: token_bucket)."""
    ring = any(o.prefill for o in outputs)
    return (token_bucket(max(o.num_tokens for o in outputs), sp, ring),
            bucket(max(len(o.sequences) for o in outputs)))


def prefill_sizes(max_tokens: int, sp: int = 1) -> list[int]:
    """Token counts of prompt steps: the budget and its quarters down to 16 (256: 16, 64, 256), so a prompt
    step pads to under 4x its tokens (or to the smallest size) and a server needs a handful of prefill
    programs, not one per power of two and sequence count; each a token_bucket under sp."""
    sizes = {token_bucket(max_tokens >> 2 * k, sp, ring=True) for k in range(max_tokens.bit_length())
             if max_tokens >> 2 * k >= 16}
    return sorted(sizes)


def table_width(max_len: int, page_size: int, sp: int = 1) -> int:
    """Page-table entries per sequence: the pages of the longest sequence an engine admits, a multiple of sp.
    One width per engine, so no sequence length ever needs another program (vLLM's block table is as wide
    as max_model_len too); attention reads only the entries each sequence needs."""
    pages = -(-max_len // page_size)
    return -(-pages // sp) * sp


def pack(outputs: list[SchedulerOutput], page_size: int, pool_pages: int, width: int,
         shape: tuple[int, int] | None = None, sp: int = 1,
         failures: dict[str, BaseException] | None = None) -> StepBatch:
    """One row per replica (outputs[i] is replica i's work), padded to shared bucket shapes (`shape`, at
    least bucket_shape(outputs, sp), when several batches must share one) and page tables `width` entries
    wide (table_width), tokens in ring order under sp.

    failures: where given, a sequence that cannot be packed is recorded there (request id -> error) and laid
    out inert in its place (its tokens write no K/V, it draws greedily), so that the others keep their slots
    and the step goes on without it; else its error is raised."""
    P, R = page_size, len(outputs)
    N, S = shape or bucket_shape(outputs, sp)
    sentinel = pool_pages * P
    tokens, positions = np.zeros((R, N), np.int32), np.zeros((R, N), np.int32)
    slots = np.full((R, N), sentinel, np.int32)
    page_table = np.zeros((R, S, width), np.int32)
    seq_lens, logits_index = np.zeros((R, S), np.int32), np.zeros((R, S), np.int32)
    query_start, num_seqs = np.zeros((R, S + 1), np.int32), np.zeros(R, np.int32)
    token_seq, feed = np.full((R, N), -1, np.int32), np.full((R, N), -1, np.int32)
    sampling, logprobs = SamplingArrays.padding(R * S), False
    targets, prompt_top = None, 0    # prompt log-probabilities: only where a sequence asks (prompt_targets)
    for i, out in enumerate(outputs):
        t = 0
        for s, seq in enumerate(out.sequences):
            n = len(seq.token_ids)
            try:
                pos = np.arange(seq.start, seq.end)
                pages = np.asarray(seq.pages)
                if len(pages) > width:
                    raise ValueError(f"a sequence holds {len(pages)} pages, more than the page table's {width} entries")
                tokens[i, t: t + n] = seq.token_ids
                slots[i, t: t + n] = pages[pos // P] * P + pos % P
                page_table[i, s, : len(pages)] = pages
                feed[i, t + n - 1] = seq.feed
                sampling.put(i * S + s, seq.params, seq.seed)
                logprobs |= bool(seq.params.logprobs)
                if seq.prompt_targets is not None:
                    targets = np.full((R, N), -1, np.int32) if targets is None else targets
                    targets[i, t: t + n] = seq.prompt_targets
                    prompt_top = max(prompt_top, MAX_LOGPROBS if seq.params.prompt_logprobs else 0)
                end = seq.end
            except Exception as e:
                if failures is None:
                    raise
                failures[seq.request_id] = e
                pos, end = np.arange(n), n
                tokens[i, t: t + n], slots[i, t: t + n], page_table[i, s], feed[i, t + n - 1] = 0, sentinel, 0, -1
                sampling.put(i * S + s, GREEDY, 0)
                if targets is not None:
                    targets[i, t: t + n] = -1
            positions[i, t: t + n] = pos
            token_seq[i, t: t + n] = s
            seq_lens[i, s] = end
            logits_index[i, s] = t + n - 1
            query_start[i, s + 1] = t + n
            t += n
        query_start[i, len(out.sequences) + 1:] = t
        num_seqs[i] = len(out.sequences)
    order = ring_order(N, sp)
    tokens, positions, slots, token_seq, feed = (a[:, order] for a in (tokens, positions, slots, token_seq, feed))
    targets = None if targets is None else targets[:, order]
    logits_index = np.argsort(order).astype(np.int32)[logits_index]
    ring = sp > 1 and any(o.prefill for o in outputs)
    meta = StepMetadata(positions, slots, page_table, seq_lens, query_start, num_seqs, token_seq, ring,
                        has_cached_context(ring, outputs))
    sampling = sampling.replace(top_logprobs=MAX_LOGPROBS if logprobs else 0)
    return StepBatch(tokens, logits_index, seq_lens.reshape(-1), sampling, meta, feed, targets, prompt_top)


def has_cached_context(ring: bool, outputs: list[SchedulerOutput]) -> bool:
    """StepMetadata.cached: False only for a ring step in which every sequence starts at 0 (no keys to read
    from the pages)."""
    return not ring or any(seq.start > 0 for o in outputs for seq in o.sequences)


Microbatch = list[SchedulerOutput] | None  # one output per replica; None where nothing was ever scheduled


def has_work(mb: Microbatch) -> bool:
    return mb is not None and any(mb)


class Packer:
    """The shapes of one engine's steps, and its scheduled work packed into them, so that the engine, its
    warm-up and the XLA floor pack alike. A step's bucket is `shape` of its work: a step with prompt tokens
    takes the next of a few prefill sizes (prefill_sizes) and as many sequence slots as it may hold (its
    tokens, at most max_seqs): prompt steps are compute-bound, so padding costs less than a compile, and the
    warm-up's few programs serve every prompt (jaxinfer.engine.warmup). Empty slots cost the head a row each
    and the sampler nothing on CPU (it draws row by row, jaxinfer.sampling.sample)."""

    def __init__(self, page_size: int, pool_pages: int, max_len: int, max_tokens: int, max_seqs: int,
                 sp: int = 1, stages: int = 1):
        """pool_pages: pages of one replica's pool (over its sp ranks); max_len: the longest sequence admitted;
        max_tokens, max_seqs: a step's budgets per replica (rounded up to their buckets here)."""
        self.page_size, self.pool_pages, self.sp, self.stages = page_size, pool_pages, sp, stages
        self.max_tokens = bucket(max_tokens, 16)
        self.max_seqs = bucket(min(max_seqs, self.max_tokens))   # sequence slots of the widest step
        self.prefill_sizes = prefill_sizes(self.max_tokens, sp)
        self.table_width = table_width(max_len, page_size, sp)

    def shape(self, outputs: list[SchedulerOutput]) -> tuple[int, int]:
        """(tokens, sequences) per replica of the step that runs `outputs` (see the class docstring)."""
        tokens, seqs = bucket_shape(outputs, self.sp)
        if any(o.prefill for o in outputs):
            tokens = next(n for n in self.prefill_sizes if n >= tokens)
            seqs = min(tokens, self.max_seqs)
        return tokens, seqs

    def pack(self, outputs: list[SchedulerOutput], shape: tuple[int, int] | None = None,
             failures: dict[str, BaseException] | None = None) -> StepBatch:
        """One step of the replicas' outputs, in its bucket (or `shape`); `failures` as in `pack`."""
        return pack(outputs, self.page_size, self.pool_pages, self.table_width, shape or self.shape(outputs),
                    self.sp, failures)

    def pack_stages(self, stages: list[Microbatch], failures: dict[str, BaseException] | None = None,
                    shape: tuple[int, int] | None = None) -> StepBatch | PipelineBatch:
        """The microbatch each pipeline stage runs in one call (stages[s] at stage s; stages[0], just scheduled,
        never None); one stage: a plain step. Every stage takes one shared bucket (`shape` where given, at least
        each stage's own; under sp, one kind of attention: the ring if any stage prefills)."""
        if self.stages == 1:
            return self.pack(stages[0], shape, failures)
        empty = [SchedulerOutput([])] * len(stages[0])
        outputs = [mb or empty for mb in stages]
        tokens, seqs = shape or tuple(map(max, *(self.shape(o) for o in outputs)))
        ring = self.sp > 1 and any(o.prefill for mb in outputs for o in mb)
        shape = (token_bucket(tokens, self.sp, ring), seqs)   # decode stages' rows go round the ring too
        cached = has_cached_context(ring, [o for mb in outputs for o in mb])
        batches = [b.replace(meta=b.meta.replace(ring=ring, cached=cached))
                   for b in (self.pack(o, shape, failures) for o in outputs)]
        meta = jax.tree.map(lambda *m: np.stack(m), *(b.meta for b in batches))
        first, last = batches[0], batches[-1]
        active = np.array([has_work(mb) for mb in stages])
        return PipelineBatch(first.tokens, first.feed, meta, active, last.logits_index, last.sample_positions,
                             last.sampling, last.prompt_targets, last.prompt_top)
