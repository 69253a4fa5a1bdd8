"""Host-side page allocator of one replica: free list, reference counts, and the prefix cache.

A full page is keyed by a chained hash of its tokens (the hash of the page before it and its own
tokens), so equal keys mean equal prefixes. Requests that share a prompt prefix share its pages by
reference count; a cached page nobody references stays cached until it is evicted, least recently
used first, when free pages run out (vLLM's automatic prefix caching).
"""

from __future__ import annotations

from collections import OrderedDict


def page_hashes(tokens: list[int], page_size: int, parent: int | None = None) -> list[int]:
    """Chained hashes of the full pages of `tokens` (which follow the page hashed `parent`, if any)."""
    hashes = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = hash((parent, tuple(tokens[start: start + page_size])))
        hashes.append(parent)
    return hashes


class PagePool:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True):
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.refs = [0] * num_pages
        self.cached: dict[int, int] = {}                 # hash -> page
        self.hash_of: dict[int, int] = {}                # page -> hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages with no reference, LRU first
        self.hits = 0                                    # pages served from the prefix cache
        self.queries = 0                                 # full prompt pages looked up

    @property
    def available(self) -> int:
        """Pages that an allocation can take now (free, or cached and unreferenced)."""
        return len(self.free) + len(self.evictable)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages, or None (and nothing taken) if there are not enough."""
        if n > self.available:
            return None
        pages = []
        for _ in range(n):
            if self.free:
                page = self.free.pop()
            else:
                page, _ = self.evictable.popitem(last=False)
                del self.cached[self.hash_of.pop(page)]
            self.refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            assert self.refs[page] >= 0, f"page {page} released more often than taken"
            if self.refs[page] == 0:
                if page in self.hash_of:
                    self.evictable[page] = None
                else:
                    self.free.append(page)

    def lookup(self, hashes: list[int]) -> list[int]:
        """The cached pages of the longest prefix of `hashes`, each now referenced by the caller."""
        if not self.prefix_caching:
            return []
        self.queries += len(hashes)
        pages = []
        for h in hashes:
            page = self.cached.get(h)
            if page is None:
                break
            if self.refs[page] == 0:
                self.evictable.pop(page)
            self.refs[page] += 1
            pages.append(page)
        self.hits += len(pages)
        return pages

    def register(self, page: int, h: int) -> None:
        """Offer a page that just became full to the prefix cache (first writer wins)."""
        if self.prefix_caching and h not in self.cached and page not in self.hash_of:
            self.cached[h] = page
            self.hash_of[page] = h
