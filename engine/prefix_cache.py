"""Prefix caching: find the cached pages a new sequence can adopt, and publish full pages.

A full page of a token stream is named by a chain hash (as vLLM does): the hash of page i
covers the hash of page i-1 and the page's own token ids, so equal hashes mean equal
tokens from position 0 up to the end of that page, and therefore equal K/V. `PrefixChain`
computes these hashes for one stream as its pages fill; `find_prefix` walks a prompt's
chain through the cache's hash index (engine/cache.py) and stops at the first miss;
`publish` registers a sequence's newly filled pages so later sequences can find them.

Contract:
- Only full pages are hashed and adopted, so an adopting sequence's length ends on a page
  boundary and its next write goes to a page of its own (the invariant in engine/cache.py
  that makes copy-on-write unnecessary).
- `root` separates caches that must not mix although their tokens agree (a different LoRA
  selection, say): chains from different roots never share a page.
- blake2b, not Python's `hash`: a collision would silently serve another prompt's K/V.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq
from hashlib import blake2b

from engine.pages import PagePool, Sequence

ROOT = b"kestrel-prefix-v1"
_DIGEST = 16


def root_hash(salt: str = "") -> bytes:
    """The chain's start for a namespace (`salt`, e.g. a LoRA selection); "" is the base."""
    return ROOT if not salt else blake2b(ROOT + salt.encode(), digest_size=_DIGEST).digest()


class PrefixChain:
    """Chain hashes of one token stream's full pages, computed once each, in order."""

    def __init__(self, page_size: int, root: bytes = ROOT) -> None:
        self.page_size = page_size
        self.root = root
        self.hashes: list[bytes] = []

    def get(self, page: int, tokens: Seq[int]) -> bytes:
        """The hash of full page `page` of `tokens` (those pages must be present)."""
        ps = self.page_size
        while len(self.hashes) <= page:
            i = len(self.hashes)
            if len(tokens) < (i + 1) * ps:
                raise ValueError(f"page {i} of {len(tokens)} tokens is not full")
            parent = self.hashes[-1] if self.hashes else self.root
            ids = array("q", tokens[i * ps : (i + 1) * ps]).tobytes()
            self.hashes.append(blake2b(parent + ids, digest_size=_DIGEST).digest())
        return self.hashes[page]


def find_prefix(cache: PagePool, chain: PrefixChain, tokens: Seq[int], max_pages: int) -> list[int]:
    """Cached pages that hold `tokens`' first full pages, at most `max_pages`, in order.

    Nothing is acquired: the caller decides whether to adopt them (`adopt`)."""
    pages: list[int] = []
    for i in range(min(max_pages, len(tokens) // chain.page_size)):
        page = cache.lookup(chain.get(i, tokens))
        if page is None:
            break
        pages.append(page)
    return pages


def adopt(cache: PagePool, seq: Sequence, pages: list[int]) -> int:
    """Give an empty sequence the cached `pages` (one more holder each); returns the
    number of tokens it now holds."""
    if seq.pages or seq.length:
        raise ValueError("only an empty sequence can adopt a cached prefix")
    cache.acquire(pages)
    seq.pages = list(pages)
    seq.length = len(pages) * cache.page_size
    return seq.length


def publish(cache: PagePool, seq: Sequence, chain: PrefixChain, tokens: Seq[int], done: int) -> int:
    """Register the sequence's full pages from index `done` on; returns the new count.

    `tokens` must start with the tokens the sequence's cache holds."""
    full = seq.length // cache.page_size
    for i in range(done, full):
        cache.register(seq.pages[i], chain.get(i, tokens))
    return max(done, full)
