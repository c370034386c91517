"""One job's constraint: its llguidance matcher kept in step with the job's tokens."""

from __future__ import annotations

from typing import Any

CONSTRAINT_ERROR = "constraint_error"  # the finish reason of a job its grammar left stuck
# The finish reason of a job whose grammar is complete and allows nothing more: with EOS
# banned (ban_eos_token) no stop token is open to end it, so the grammar's end ends it.
GRAMMAR_COMPLETE = "stop"


class JobConstraint:
    """The matcher has consumed `consumed` of the job's generated tokens (a prefix of them:
    tokens only change at the end). `failed` holds why the job cannot go on, if so;
    `complete` says its grammar has ended and allows no more tokens. `lane`: the mask lane
    whose lexer its matcher shares (engine/constraints/compiler.py)."""

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
        self.complete = False

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
            self.complete = False  # a rewind reopened the grammar
        if self.complete:  # the token drawn after the grammar's end is not used
            return
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

    @property
    def open(self) -> bool:
        """Whether the job still needs masks: neither failed nor complete."""
        return self.failed is None and not self.complete

    def finish_reason(self) -> str | None:
        """Why the job cannot go on (CONSTRAINT_ERROR, GRAMMAR_COMPLETE), or None."""
        if self.failed is not None:
            return CONSTRAINT_ERROR
        return GRAMMAR_COMPLETE if self.complete else None
