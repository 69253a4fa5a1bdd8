"""PagePool on its own (no device): allocation, reference counts, LRU eviction, the prefix cache and its keys."""

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from jaxinfer.engine.page_pool import ROOT_KEY, PagePool, page_hashes

P = 4  # page size


def _key(parent: bytes, tokens: list[int]) -> bytes:
    """The documented encoding: sha256(parent key + token ids as little-endian int64)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def _cached_pool(num_pages: int, tokens: list[int]) -> tuple[PagePool, list[int], list[bytes]]:
    """A pool holding `tokens` in cached pages that one request still references."""
    pool = PagePool(num_pages, P)
    keys = page_hashes(tokens, P)
    pages = pool.allocate(len(keys))
    for page, key in zip(pages, keys, strict=True):
        pool.register(page, key)
    return pool, pages, keys


# ---- allocation and reference counts ------------------------------------------------------------------------


def test_allocate_hands_out_distinct_pages():
    pool = PagePool(6, P)
    a, b = pool.allocate(2), pool.allocate(3)
    assert a == [0, 1] and b == [2, 3, 4]
    assert pool.available == 1 and pool.free == [5]
    assert [pool.refs[p] for p in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.allocate(0) == []


def test_allocate_refuses_without_taking_anything():
    pool = PagePool(4, P)
    pool.allocate(3)
    assert pool.allocate(2) is None
    assert pool.free == [3] and pool.refs == [1, 1, 1, 0] and pool.available == 1
    assert pool.allocate(1) == [3] and pool.allocate(1) is None


def test_release_returns_uncached_pages_to_free():
    pool = PagePool(4, P)
    pages = pool.allocate(4)
    pool.release([pages[2], pages[0]])
    assert pool.free == [0, 2] and pool.refs == [0, 1, 0, 1] and pool.available == 2
    assert pool.allocate(2) == [0, 2]                      # page 1 is taken, so page 0 is followed by page 2
    assert not pool.evictable and not pool.cached


def test_growing_sequences_keep_their_pages_consecutive():
    pool = PagePool(64, P)
    seqs = [pool.allocate(2) for _ in range(8)]            # eight prompts, then all grow in lockstep
    for _ in range(4):
        seqs = [pages + pool.allocate(1, pages) for pages in seqs]
    for pages in seqs:
        assert pages == list(range(pages[0], pages[0] + 6))
    assert seqs[0][0] == 0 and len({p for pages in seqs for p in pages}) == 48


def test_a_sequence_that_cannot_follow_its_last_page_starts_a_new_run_in_the_largest_gap():
    pool = PagePool(16, P)
    a = pool.allocate(4)                                   # 0-3: the rank's first run starts at its first page
    b = pool.allocate(2)                                   # centred in 4-15: room behind a and after b
    assert a == [0, 1, 2, 3] and b == [9, 10]
    c = pool.allocate(4, b)                                # follows b
    assert c == [11, 12, 13, 14] and pool.allocate(2, a) == [4, 5]
    assert pool.allocate(2, c) == [15, 7]                  # past the rank's end: the centre of the run 6-8


def test_releasing_too_often_asserts():
    pool = PagePool(2, P)
    pages = pool.allocate(1)
    pool.release(pages)
    with pytest.raises(AssertionError, match="page 0 released more often than taken"):
        pool.release(pages)


def test_lookups_of_a_shared_prefix_share_pages():
    tokens = list(range(10, 22))                           # 3 full pages
    pool, pages, keys = _cached_pool(5, tokens)
    a = pool.lookup(keys)
    b = pool.lookup(keys[:2])
    assert a == pages and b == pages[:2]
    assert [pool.refs[p] for p in pages] == [3, 3, 2]
    assert (pool.hits, pool.queries) == (5, 5)
    pool.release(pages)                                    # the writer is done
    pool.release(a)
    assert [pool.refs[p] for p in pages] == [1, 1, 0]
    assert list(pool.evictable) == [pages[2]] and pool.available == 2 + 1
    pool.release(b)                                        # only now do the first two pages become evictable
    assert pool.refs[:3] == [0, 0, 0] and list(pool.evictable) == [pages[2], pages[0], pages[1]]
    assert pool.free == [3, 4] and pool.available == 5


def test_cached_pages_go_to_evictable_not_free():
    pool, pages, keys = _cached_pool(4, list(range(8)))
    pool.release(pages)
    assert pool.free == [2, 3] and list(pool.evictable) == pages
    assert pool.cached == {keys[0]: 0, keys[1]: 1} and pool.hash_of == {0: keys[0], 1: keys[1]}


# ---- LRU eviction and prefix hits -------------------------------------------------------------------------


def test_eviction_takes_free_pages_first_then_least_recently_released():
    pool = PagePool(5, P)
    seqs = [[i] * P for i in range(3)]                     # three one-page sequences
    owned = []
    for tokens in seqs:
        (page,) = pool.allocate(1)
        pool.register(page, page_hashes(tokens, P)[0])
        owned.append(page)
    for page in (owned[1], owned[0], owned[2]):            # release order: 1, 0, 2
        pool.release([page])
    assert list(pool.evictable) == [owned[1], owned[0], owned[2]]
    free = pool.free
    assert len(free) == 2 and pool.allocate(2) == free     # the free pages go first, nothing is evicted
    assert len(pool.cached) == 3
    assert pool.allocate(1) == [owned[1]]                  # then the least recently released
    assert page_hashes(seqs[1], P)[0] not in pool.cached and owned[1] not in pool.hash_of
    assert pool.allocate(1) == [owned[0]]
    assert list(pool.evictable) == [owned[2]] and pool.lookup(page_hashes(seqs[2], P)) == [owned[2]]


def test_lookup_hit_takes_a_page_out_of_evictable():
    pool = PagePool(3, P)
    keys = []
    for i in range(3):
        (page,) = pool.allocate(1)
        keys.append(page_hashes([i] * P, P)[0])
        pool.register(page, keys[-1])
    pool.release([0, 1, 2])
    assert pool.lookup([keys[0]]) == [0]                   # the least recently released, now referenced again
    assert list(pool.evictable) == [1, 2] and pool.available == 2
    pool.release([0])                                      # released again: now the most recently used
    assert list(pool.evictable) == [1, 2, 0]
    assert pool.allocate(2) == [1, 2] and pool.lookup([keys[0]]) == [0]


def test_evicted_page_no_longer_hits_and_lookup_stops_at_first_miss():
    tokens = list(range(100, 112))                         # 3 pages: A, B, C
    pool, pages, keys = _cached_pool(3, tokens)
    pool.release([pages[1]])                               # B becomes evictable first
    pool.release([pages[0], pages[2]])
    assert pool.allocate(1) == [pages[1]]                  # evicts B
    hits, queries = pool.hits, pool.queries
    assert pool.lookup(keys) == [pages[0]]                 # A hits, B misses, C is never consulted
    assert pool.refs[pages[2]] == 0 and pages[2] in pool.evictable
    assert (pool.hits - hits, pool.queries - queries) == (1, 3)
    assert pool.lookup(keys[1:]) == []


def test_register_is_first_writer_wins():
    pool = PagePool(4, P)
    key, other = page_hashes([1, 2, 3, 4], P)[0], page_hashes([5, 6, 7, 8], P)[0]
    a, b = pool.allocate(2)
    pool.register(a, key)
    pool.register(b, key)                                  # same content written twice: the first page stays
    pool.register(a, other)                                # a page keeps its first key
    assert pool.cached == {key: a} and pool.hash_of == {a: key}
    pool.release([a, b])
    assert pool.free == [b, 2, 3] and list(pool.evictable) == [a]


def test_no_prefix_caching_caches_nothing():
    pool = PagePool(3, P, prefix_caching=False)
    keys = page_hashes(list(range(8)), P)
    pages = pool.allocate(2)
    for page, key in zip(pages, keys, strict=True):
        pool.register(page, key)
    assert pool.cached == {} and pool.hash_of == {}
    assert pool.lookup(keys) == [] and (pool.hits, pool.queries) == (0, 0)
    pool.release(pages)
    assert not pool.evictable and sorted(pool.free) == [0, 1, 2]


# ---- the keys ---------------------------------------------------------------------------------------------


def test_keys_are_sha256_of_the_documented_encoding():
    tokens = [1, 2, 3, 4, 150000, 0, 7, 2**40, 9]          # two full pages and one token over
    keys = page_hashes(tokens, P)
    assert ROOT_KEY == bytes(32)
    first = _key(bytes(32), [1, 2, 3, 4])
    assert keys == [first, _key(first, [150000, 0, 7, 2**40])]
    assert all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert keys[0] == hashlib.sha256(bytes(32) + b"".join(t.to_bytes(8, "little") for t in [1, 2, 3, 4])).digest()
    # a known answer: the encoding must not change by accident
    assert keys[0].hex() == "ffb37f396c221c1e32e2d90de01d531aa5e704f43017ac4142d39b24fe4d6c58"


def test_keys_chain_from_the_parent():
    keys = page_hashes(list(range(12)), P)
    assert page_hashes(list(range(4, 12)), P, parent=keys[0]) == keys[1:]  # resuming the chain
    assert page_hashes(list(range(3)), P) == [] and page_hashes([], P) == []


def test_same_tokens_after_different_parents_differ():
    page = [5, 6, 7, 8]
    a = page_hashes([1, 2, 3, 4] + page, P)
    b = page_hashes([1, 2, 3, 9] + page, P)
    assert a[0] != b[0] and a[1] != b[1]
    assert page_hashes(page, P)[0] not in (a[1], b[1])     # nor equal to the page starting a sequence
    assert page_hashes(page, P, parent=a[0]) == [a[1]]


def test_keys_are_stable_across_processes():
    tokens = list(range(1000, 1013))
    root = Path(__file__).resolve().parents[1]
    # Load the module file on its own: the keys must not depend on the process (Python's hash() did).
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('pp', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            f"print(' '.join(k.hex() for k in m.page_hashes({tokens}, {P})))")
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run([sys.executable, "-c", code, str(root / "jaxinfer" / "engine" / "page_pool.py")],
                             env=env, capture_output=True, text=True, check=True, timeout=60)
        outs.append(run.stdout.split())
    assert outs[0] == outs[1] == [k.hex() for k in page_hashes(tokens, P)]
    assert len(outs[0]) == 3
