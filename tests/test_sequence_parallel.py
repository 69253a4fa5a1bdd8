"""Sequence parallel over sp (jaxinfer/device/attention/ring.py): ring attention for prefill, decode over KV pages
sharded across sp, the per-rank page allocator, the compiled step's communication and refusals. The
fixtures' logits and greedy paths at sp layouts are in test_fixtures.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.collectives import collective_report
from jaxinfer.device.attention import attention
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.engine.core import RequestError
from jaxinfer.engine.packer import pack, table_width, token_bucket
from jaxinfer.engine.page_pool import PagePool, page_hashes
from jaxinfer.engine.scheduler import ScheduledSequence, SchedulerOutput
from jaxinfer.engine.warmup import warmup_shapes
from jaxinfer.mesh import MeshConfig, MeshError
from jaxinfer.random_model import DEFAULT
from jaxinfer.sharding import Layout
from jaxinfer.step import ring_order

TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [1, *np.random.default_rng(seed).integers(4, 260, size=n - 1).tolist()]


@pytest.fixture(scope="module")
def one(tiny_llm):
    return tiny_llm(max_tokens_per_step=64)


@pytest.fixture(scope="module")
def sp4(hf_tiny):
    """8 pages of 16 tokens per device: 128 tokens, 512 over the four ranks (the model's whole context)."""
    return LLM(hf_tiny / "llama", mesh="sp=4", dtype="float32", max_tokens_per_step=64, num_pages=8)


# ---- the page allocator ---------------------------------------------------------------------------------
def test_pages_of_a_sequence_go_round_the_ranks_and_each_rank_runs_out_on_its_own():
    pool = PagePool(8, page_size=4, ranks=4)                   # 2 pages per rank: ids 2k, 2k + 1 on rank k
    a = pool.allocate(5)
    assert [pool.rank_of(p) for p in a] == [0, 1, 2, 3, 0]
    assert a == [0, 2, 4, 6, 1]                                 # page 4 follows page 0 on rank 0
    assert pool.allocate(1, a[:1]) == [3]                       # rank 1's last page
    assert pool.allocate(2, a[:1]) is None and pool.allocate(1, a[:4]) is None  # ranks 1 and 0 are full
    assert pool.available == 2                                  # while ranks 2 and 3 have a page each
    pool.release(a)
    assert pool.available == 7 and sorted(pool.free) == [0, 1, 2, 4, 5, 6, 7]


def test_a_cached_page_keeps_its_rank_and_evicts_on_its_own_rank():
    pool = PagePool(4, page_size=2, ranks=2)
    tokens = [1, 2, 3, 4, 5, 6]
    keys = page_hashes(tokens, 2)
    pages = pool.allocate(3)
    for p, k in zip(pages, keys, strict=True):
        pool.register(p, k)
    pool.release(pages)                                         # all three cached, none referenced
    assert pool.lookup(keys[:2]) == pages[:2]                   # page i of the hit is on rank i mod 2
    pool.release(pages[:2])
    fresh = pool.allocate(2, pages[:1])                         # rank 1 then rank 0: rank 0 evicts its LRU page
    assert [pool.rank_of(p) for p in fresh] == [1, 0] and fresh[1] == pages[2]
    assert keys[2] not in pool.cached and pool.lookup(keys[:2]) == pages[:2]


def test_ring_order_gives_rank_r_chunks_r_and_2w_minus_1_minus_r():
    assert ring_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]   # MaxText's reorder for cp=2
    assert sorted(ring_order(24, 3).tolist()) == list(range(24)) and ring_order(5, 1).tolist() == list(range(5))
    # a decode-only step is padded to a token per rank and keeps its order; a ring step pairs 2 x sp chunks
    assert (token_bucket(1, 4), token_bucket(5, 4), token_bucket(1, 4, ring=True)) == (4, 8, 8)
    assert ring_order(4, 4).tolist() == [0, 1, 2, 3] and ring_order(3, 3).tolist() == [0, 1, 2]


# ---- attention alone: the ring and the sharded decode against one device ------------------------------
def _attend(layout: Layout, pool: PagePool, steps: list[list[tuple]], rng_seed: int = 0,
            backend: str = "xla") -> list[np.ndarray]:
    """Run attention (no model) on random q/k/v for a list of steps of (request, start, n, pages) and return
    the outputs of the real tokens in token order, so two layouts (and backends) can be compared."""
    L, KV, H, D, P = 1, 2, 4, 16, pool.page_size
    cache = PagedKVCache.zeros(L, KV, pool.num_pages, P, D, jnp.float32, layout)
    inv_freq = 1.0 / 10000 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D)
    rng, outs = np.random.default_rng(rng_seed), []
    sp = layout.axis_size("seq")
    for step in steps:
        seqs = [ScheduledSequence(rid, [0] * n, start, pages, GREEDY, 0, samples=True, prefill=n > 1)
                for rid, start, n, pages in step]
        batch = pack([SchedulerOutput(seqs)], P, pool.num_pages, table_width(pool.num_pages * P, P, sp), sp=sp)
        N, n_real = batch.tokens.shape[1], sum(s[2] for s in step)
        order = ring_order(N, sp)
        q, k, v = (rng.standard_normal((1, n_real, h, D)).astype(np.float32) for h in (H, KV, KV))
        placed = [np.zeros((1, N, *x.shape[2:]), np.float32) for x in (q, k, v)]
        for x, y in zip((q, k, v), placed, strict=True):
            y[:, np.argsort(order)[:n_real]] = x                  # token t sits where ring order put it

        def f(q, k, v, cache, meta):
            return attention(q, k, v, cache, jnp.int32(0), inv_freq, meta, layout, backend)

        out, cache = jax.jit(f)(*placed, cache, batch.meta)
        outs.append(np.asarray(out)[0, np.argsort(order)[:n_real]])
    return outs


def _plan(ranks: int, P: int) -> tuple[PagePool, list[list[tuple]]]:
    """Two sequences: a 3-chunk prefill (the later chunks attend to pages written by the earlier ones on
    every rank), a chunk mixed with a decode, then decodes at long context."""
    pool = PagePool(64, P, ranks=ranks)
    a, b = pool.allocate(20), pool.allocate(20)
    return pool, [[("a", 0, 30, a)], [("a", 30, 29, a), ("b", 0, 7, b)], [("a", 59, 1, a), ("b", 7, 30, b)],
                  [("a", 60, 1, a), ("b", 37, 1, b)], [("b", 38, 1, b)]]


@functools.cache
def _one_device(P: int) -> list[np.ndarray]:
    return _attend(Layout(MeshConfig().make()), *_plan(1, P))


# the jnp reference at sp=4 and the C++ kernel at sp=2 and 4 (the Pallas kernel under sp: the engine test below)
@pytest.mark.parametrize("sp,backend,P", [(4, "xla", 4), (2, "cpu", 8), (4, "cpu", 4)])
def test_ring_prefill_with_cached_context_and_sharded_decode_equal_one_device(sp, backend, P):
    """_plan's steps; each rank's pages read by the backend's kernel (page stride sp, offset rank, the
    log-sum-exp out)."""
    mesh = Layout(MeshConfig(sp=sp).make())
    for got, want in zip(_attend(mesh, *_plan(sp, P), backend=backend), _one_device(P), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


# ---- the engine ----------------------------------------------------------------------------------------
def test_a_prompt_too_long_for_one_devices_pool_runs_at_sp4_as_on_one_device_with_a_larger_pool(hf_tiny, one, sp4):
    """300 tokens need 19 pages; one device's 8 cannot hold them, four ranks' 32 can. The prompt is chunked
    (64 tokens a step), so every chunk after the first attends to pages written earlier on every rank."""
    long = prompt(300)
    small = LLM(hf_tiny / "llama", dtype="float32", num_pages=8)
    with pytest.raises(RequestError, match="does not fit the KV page pool of 128 tokens"):
        small.generate([long], GREEDY)
    # a request must fit one replica's pool with all its max_tokens; under sp that is all its ranks' pages
    with pytest.raises(RequestError, match=r"need 140 tokens of KV cache, more than the page pool's 128") as e:
        small.generate([long[:100]], SamplingParams(max_tokens=40, temperature=0))
    assert e.value.param == "max_tokens" and "at most 28 new tokens" in str(e.value)
    assert sp4.engine.capacity == 4 * 8 * 16
    sp4.engine.check_request(long, SamplingParams(max_tokens=212))   # 512 tokens: the four ranks' pages
    np.testing.assert_allclose(sp4.logits([long])[0], one.logits([long])[0], atol=TOL, rtol=0)
    assert sp4.generate([long], GREEDY)[0].token_ids == one.generate([long], GREEDY)[0].token_ids
    pool = sp4.engine.schedulers[0].pool
    assert pool.available == pool.num_pages == 32


def test_a_prefix_cache_hit_at_sp4_reads_pages_on_every_rank(sp4, one):
    base = prompt(100, seed=1)
    pool = sp4.engine.schedulers[0].pool
    sp4.generate([base], GREEDY)
    hits = pool.hits
    ours = sp4.generate([base + [7, 8, 9]], GREEDY)[0]
    assert pool.hits - hits == 6                                 # the 6 full pages of the base prompt
    assert ours.token_ids == one.generate([base + [7, 8, 9]], GREEDY)[0].token_ids


def test_sp4_prefill_permutes_w_minus_1_times_per_layer_and_decode_bytes_do_not_grow_with_context(sp4):
    """Counted in the compiled steps (loops times their trip counts), per device, float32."""
    cfg, W = sp4.config, 4
    L, H, KV, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    reports = {}
    for n in (20, 200):
        sp4.generate([prompt(n, seed=n)], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        runner = sp4.engine.runner
        reports[n] = {phase: collective_report(runner.last[phase].as_text()) for phase in ("prefill", "decode")}
    # the last prefill chunk: 20 tokens and 200 - 3 * 64 = 8 tokens, in the prompt-step sizes 16 and 64
    assert sp4.engine.packer.prefill_sizes == [16, 64]
    for r, chunk in ((reports[20], 64), (reports[200], 16)):
        # the ring: W - 1 permutes per layer of each rank's K and V block [chunk / W tokens, 2, KV, D]
        permutes = {"count": L * (W - 1), "bytes": L * (W - 1) * chunk // W * 2 * KV * D * 4}
        assert r["prefill"]["collective-permute"] == permutes
        # keys cached before the step (the 200-token prompt's last chunk): q all-gathered, partials all-to-all
        # back; a prompt's first chunk has none, and neither collective
        layers = L if chunk == 16 else 0
        assert r["prefill"]["all-gather"] == {"count": layers, "bytes": layers * chunk * H * D * 4}
        assert r["prefill"]["all-to-all"] == {"count": layers, "bytes": layers * chunk * H * (D + 1) * 4}
        # decode: one all-gather of q, k, v and one all-to-all of (out, lse) per layer, for the bucket of W
        # tokens (one sequence: a token per rank, no ring so no 2W chunk pairing)
        N = W
        decode = r["decode"]
        assert decode["collective-permute"]["count"] == 0
        assert decode["all-gather"] == {"count": L, "bytes": L * N * (H + 2 * KV) * D * 4}
        assert decode["all-to-all"] == {"count": L, "bytes": L * N * H * (D + 1) * 4}
    assert reports[20]["decode"] == reports[200]["decode"]


def test_sp_warmup_compiles_each_prompt_step_with_and_without_cached_context(sp4):
    shapes, packer = warmup_shapes(sp4.engine), sp4.engine.packer
    prompts = [(n, s, cached) for n, s, ring, cached in shapes if ring]
    assert prompts == [(n, min(n, packer.max_seqs), c) for n in packer.prefill_sizes for c in (False, True)]
    assert all(cached for *_, ring, cached in shapes if not ring)     # decode steps: one program each


def test_sp_meshes_a_model_cannot_serve_are_refused_before_compiling(hf_tiny):
    with pytest.raises(MeshError, match="sp=8 exceeds the 4 KV pages of the model's 512-token context"):
        LLM(hf_tiny / "llama", mesh="sp=8", page_size=128)


def test_sp2_on_the_pallas_kernel_gives_one_devices_logits_and_tokens():
    """The Pallas kernel (interpret mode on CPU) reads each rank's pages: a 100-token prompt in two chunks
    (the second attends to the first's pages on both ranks), then decodes. (head_dim 16: the llama
    fixture's 8 is below what Triton tiles.)"""
    config = {**DEFAULT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
    one, sp2 = (LLM.random(config, mesh=mesh, dtype="float32", max_tokens_per_step=64, compilation_cache=False,
                           attention_backend=backend) for mesh, backend in ((None, "xla"), ("sp=2", "pallas")))
    assert sp2.engine.runner.backend == "pallas"
    long = prompt(100, seed=5)
    np.testing.assert_allclose(sp2.logits([long])[0], one.logits([long])[0], atol=TOL, rtol=0)
    assert sp2.generate([long], GREEDY)[0].token_ids == one.generate([long], GREEDY)[0].token_ids
    for llm in (one, sp2):
        llm.close()


def test_sixteen_concurrent_requests_at_sp2_with_preemption_equal_each_alone(hf_tiny):
    llm = LLM(hf_tiny / "llama", mesh="sp=2", dtype="float32", max_tokens_per_step=32, num_pages=3)
    rng = np.random.default_rng(3)
    # two pages each (one on each rank), and a third to come on rank 0 when decoding crosses token 32
    prompts = [prompt(int(rng.integers(26, 32)), seed=i) for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    together = [c.token_ids for c in llm.generate(prompts, params)]
    assert llm.engine.stats.preemptions > 0                      # 3 pages a rank: the running requests outgrow them
    assert together == [llm.generate([p], params)[0].token_ids for p in prompts]
    pool = llm.engine.schedulers[0].pool
    assert pool.available == pool.num_pages == 6 and not llm.engine.has_unfinished()


def test_a_4k_prompt_at_sp4_on_the_cpu_kernels_gives_one_devices_logits_without_a_blocks_scores():
    """4096 tokens in one step at sp=4, the C++ kernels attending the ring's blocks and reading the pages: the
    logits of one device, and the step's temporaries on a rank below a quarter of the scores of one block
    (each rank holds n = 1024 tokens, whose scores over a block of n keys would be n x H x n, 16 MiB) and
    below one device's: what a rank holds grows with its chunk, not with chunk x context (2.2 MiB measured,
    one device 5.0; the jnp reference's tiles of 128 x 256 made it 6.6)."""
    config = {**DEFAULT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
    long = prompt(4096)
    one, sp4 = (LLM.random(config, mesh=mesh, dtype="float32", max_tokens_per_step=4096, compilation_cache=False)
                for mesh in (None, "sp=4"))
    assert sp4.engine.runner.backend == "cpu"
    np.testing.assert_allclose(sp4.logits([long])[0], one.logits([long])[0], atol=TOL, rtol=0)
    n, H = 4096 // 4, config["num_attention_heads"]
    temp, one_temp = (llm.engine.runner.last["score"].memory_analysis().temp_size_in_bytes for llm in (sp4, one))
    print(f"temporaries per rank {temp / 2**20:.2f} MiB, one device {one_temp / 2**20:.2f} MiB")
    assert temp < min(n * H * n * 4 / 4, one_temp)
    for llm in (one, sp4):
        llm.close()
