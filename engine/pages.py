"""Page bookkeeping of the paged KV cache: which pages are free, who holds them, which
hold a known prefix. No tensors: the scheduler keeps its books through this interface, and
`engine.cache.PagedKVCache` adds the K/V storage those pages index.

- Every page has a reference count: the number of sequences whose page table holds it.
  `allocate` hands out pages at count 1, `acquire` adds a holder, `release` drops one.
- A page may carry a prefix hash (`register`, see engine/prefix_cache.py): it then holds
  the K/V of one exact run of tokens from position 0, and other sequences whose tokens
  start the same way may `acquire` it instead of recomputing it.
- Invariant: only full pages are hashed, and a hashed or shared page is never written.
  Writes go to positions >= a sequence's length, i.e. into its partially filled last page
  or fresh pages, and that last page is always private (count 1, no hash): a sequence
  adopts only whole pages, so its length then ends on a page boundary, and a page is
  hashed only once full. So copy-on-write never has to copy (the scheduler adopts at most
  the pages before a prompt's last token, which it must compute for the logits anyway);
  `Sequence.reserve` raises if the invariant is ever broken.
- A page whose count drops to 0 goes back to the free list, or, if it is hashed, to an
  LRU of cached-but-unused pages that `acquire` can revive. `allocate` takes free pages
  first and then evicts from that LRU, oldest first. `free_pages` counts both: a cached
  but unused page is as good as free to a caller that needs room.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.errors import KestrelError


class CacheFullError(KestrelError, RuntimeError):
    """No free pages are left for a sequence's new tokens."""


class PagePool:
    """`num_pages` pages of `page_size` token positions each."""

    def __init__(self, *, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}  # page -> prefix hash
        self._page_of: dict[bytes, int] = {}  # prefix hash -> page
        self._lru: OrderedDict[int, None] = OrderedDict()  # hashed pages at count 0

    @property
    def free_pages(self) -> int:
        """Pages `allocate` can hand out: never used plus cached but unreferenced."""
        return len(self._free) + len(self._lru)

    @property
    def cached_pages(self) -> int:
        """Pages that carry a prefix hash, in use or not."""
        return len(self._hash_of)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_shared(self, page: int) -> bool:
        """Whether writing into `page` could change what another sequence reads."""
        return self._refs[page] > 1 or page in self._hash_of

    def allocate(self, count: int) -> list[int]:
        if count > self.free_pages:
            raise CacheFullError(
                f"the KV cache needs {count} more pages of {self.page_size} tokens, "
                f"{self.free_pages} are free"
            )
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Add a holder to pages another sequence holds or the LRU keeps."""
        for page in pages:
            if self._refs[page] == 0:
                if page not in self._lru:
                    raise RuntimeError(f"page {page} is free; only cached pages can be acquired")
                del self._lru[page]
            self._refs[page] += 1

    def release(self, pages: list[int]) -> None:
        # Last page first: the LRU then evicts the end of a prefix before its start, and a
        # prefix is only ever found from its start; the free list hands out pages in order.
        for page in reversed(pages):
            if self._refs[page] <= 0:
                raise RuntimeError(f"page {page} released more often than it was held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def lookup(self, prefix_hash: bytes) -> int | None:
        """The page holding the tokens that `prefix_hash` names, if it is still cached."""
        return self._page_of.get(prefix_hash)

    def register(self, page: int, prefix_hash: bytes) -> bool:
        """Mark a full, held page as holding the tokens `prefix_hash` names.

        Returns False (and leaves the page private) when another page already holds them:
        two jobs prefilled the same prefix at once, and the first one's page serves."""
        if self._refs[page] <= 0:
            raise RuntimeError(f"page {page} is not held; only held pages can be registered")
        known = self._page_of.get(prefix_hash)
        if known is not None or page in self._hash_of:
            return known == page
        self._page_of[prefix_hash] = page
        self._hash_of[page] = prefix_hash
        return True

    def clear_prefix_cache(self) -> None:
        """Forget every prefix hash; unreferenced cached pages become plain free pages."""
        self._free.extend(reversed(self._lru))
        self._lru.clear()
        self._hash_of.clear()
        self._page_of.clear()


@dataclass
class Sequence:
    """One sequence's place in the cache: its pages and how many tokens they hold."""

    pages: list[int] = field(default_factory=list)
    length: int = 0

    def reserve(self, cache: PagePool, new_length: int) -> None:
        """Make room for tokens up to `new_length`; they will be written at positions
        `length`..`new_length - 1`."""
        if new_length > self.length and self.length % cache.page_size:
            # The page the write starts in must be private (see the module docstring).
            page = self.pages[self.length // cache.page_size]
            if cache.is_shared(page):
                raise RuntimeError(f"page {page} is shared and must not be written")
        needed = -(-new_length // cache.page_size) - len(self.pages)
        if needed > 0:
            self.pages.extend(cache.allocate(needed))

    def release(self, cache: PagePool) -> None:
        cache.release(self.pages)
        self.pages = []
        self.length = 0
