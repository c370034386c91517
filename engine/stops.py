"""Stop strings over a stream of text deltas.

`StopMatcher.feed(delta)` returns the text that is safe to show and whether a stop string
was hit. Text that could still become the start of a stop string is held back, so a stop
string never leaks into the stream, not even in part; `flush()` releases what is held when
generation ends for another reason.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stop_strings: list[str]) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self._pending = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stop_strings:
            return delta, False
        text = self._pending + delta
        hits = [(text.find(s), s) for s in self.stop_strings if s in text]
        if hits:
            index, self.matched = min(hits)
            self._pending = ""
            return text[:index], True
        keep = self._partial_suffix(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
