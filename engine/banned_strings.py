"""Banned strings with rewind, with exllamav2's semantics.

`BannedStrings` watches one job's text token by token. Text that could still grow into a
banned string is held back (with the tokens behind it); when held text completes a banned
string, `feed` names the token in which the match began: the caller rewinds the job to
that token (drops it and everything after, trims their cache), bans that token at that
position and samples again. So a banned string never reaches the stream, not even in part.

Matching is case-insensitive, as in exllamav2 (both sides lowercased). Text is released
at token boundaries only, and only the tokens wholly before the longest held suffix that
may still begin a banned string: a match can only start inside that suffix.
"""

from __future__ import annotations


class BannedStrings:
    def __init__(self, strings: list[str]) -> None:
        self.strings = sorted({s.lower() for s in strings if s})
        self._held: list[tuple[int, str]] = []  # (generated-token index, its text)

    def __bool__(self) -> bool:
        return bool(self.strings)

    @property
    def held_from(self) -> int | None:
        """The index of the first held token (None: nothing is held)."""
        return self._held[0][0] if self._held else None

    def feed(self, index: int, text: str) -> tuple[str, int | None]:
        """Token `index` produced `text`: returns (text now safe to emit, None), or
        ("", the index of the token to rewind to) when a banned string was completed."""
        self._held.append((index, text))
        pieces = [t.lower() for _, t in self._held]
        low = "".join(pieces)
        hits = [low.find(s) for s in self.strings if s in low]
        if hits:
            start = min(hits)
            end = 0
            for n, piece in enumerate(pieces):
                end += len(piece)
                if end > start:
                    rewind = self._held[n][0]
                    del self._held[n:]
                    return "", rewind
        keep_from = len(low) - self._partial_suffix(low)
        released: list[str] = []
        end = 0
        while self._held:
            end += len(pieces[len(released)])
            if end > keep_from:
                break
            released.append(self._held.pop(0)[1])
        return "".join(released), None

    def flush(self) -> str:
        """Release everything held (generation ends; no banned string was completed)."""
        text = "".join(t for _, t in self._held)
        self._held.clear()
        return text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a banned string."""
        best = 0
        for s in self.strings:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
