"""Rewinding a sequence's cache: drop its newest positions (rejected draft tokens, tokens
taken back for a banned string).

Contract: `trim_sequence(cache, seq, length)` leaves the sequence holding at most `length`
positions and frees the pages past them. The next write goes to position `seq.length`,
and the page it lands in must be private (engine/cache.py: a hashed or shared page is
never written). When the position to rewind to falls inside such a page, the sequence
drops that whole page too and returns the shorter length it now holds: the caller feeds
the tokens from there again (a few tokens of recompute instead of a copy-on-write).
"""

from __future__ import annotations

from engine.pages import PagePool, Sequence


def trim_sequence(cache: PagePool, seq: Sequence, length: int) -> int:
    """Rewind `seq` to hold at most `length` positions; returns the length it holds."""
    if length < 0:
        raise ValueError(f"cannot rewind to a negative length ({length})")
    length = min(length, seq.length)
    page_size = cache.page_size
    if length % page_size:
        page = seq.pages[length // page_size]
        if cache.is_shared(page):
            length -= length % page_size
    keep = -(-length // page_size)
    if keep < len(seq.pages):
        cache.release(seq.pages[keep:])
        del seq.pages[keep:]
    seq.length = length
    return length
