"""One job's constraint: its llguidance matcher kept in step with the job's tokens."""

from __future__ import annotations

from typing import Any

CONSTRAINT_ERROR = "constraint_error"  # the finish reason of a job its grammar left stuck


class JobConstraint:
    """The matcher has consumed `consumed` of the job's generated tokens (a prefix of them:
    tokens only change at the end). `failed` holds why the job cannot go on, if so. `lane`:
    the mask lane whose lexer its matcher shares (engine/constraints/compiler.py)."""

    def __init__(
        self,
        matcher: Any,
        spec: Any,
        ll_tokenizer: Any,
        stop_ids: frozenset[int],
        lane: int = 0,
    ):
        self.matcher = matcher
        self.lane = lane
        self.spec = spec
        self.vocab = ll_tokenizer.vocab_size
        self.stop_ids = stop_ids
        self.consumed = 0
        self.failed: str | None = None

    def sync(self, generated: list[int]) -> None:
        """Roll back what the job dropped (rejected drafts, rewinds), consume what it added.
        A stop token is not consumed: it ends the job."""
        if self.failed is not None:
            return
        if len(generated) < self.consumed:
            if not self.matcher.rollback(self.consumed - len(generated)):
                self.fail(f"rollback failed: {self.matcher.get_error()}")
                return
            self.consumed = len(generated)
        new = [t for t in generated[self.consumed :] if t not in self.stop_ids]
        if new and not self.matcher.consume_tokens(new):
            self.fail(f"token not allowed: {self.matcher.get_error()}")
            return
        self.consumed = len(generated)

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of `drafts` the grammar allows in a row (a stop token ends them)."""
        if self.failed is not None:
            return 0
        stop = next((i for i, t in enumerate(drafts) if t in self.stop_ids), len(drafts))
        return self.matcher.validate_tokens(drafts[:stop]) if stop else 0

    def fail(self, why: str) -> None:
        self.failed = why
