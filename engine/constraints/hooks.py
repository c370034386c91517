"""The scheduler's three hooks into constrained decoding (and the single-job loop's).

A step's masks are computed on the host after its forward was launched: the matchers
already consumed the tokens before it (`sync_constraint` runs as each job takes its
tokens), so the host works on the masks while the GPU computes the logits. They are
written into one pinned bitmask (llguidance's executor fills many rows in parallel
threads, without the GIL), copied to the device without a host sync and applied there by
the runner's `apply_token_bitmask` (kernels/token_bitmask.py: the scheduler reaches no
kernel code itself, so the device half is passed in). A job without a constraint costs
nothing; a step without one costs one attribute look-up per row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import llguidance.torch
import torch

from engine.constraints.state import CONSTRAINT_ERROR

# (job, first logits row, drafts): the job's rows are first_row .. first_row + len(drafts),
# row j drawn after the job's tokens and drafts[:j].
MaskRow = tuple[Any, int, Sequence[int]]
# (logits [N, V], bitmask [R, ceil(V / 32)] int32, rows [R] int64) -> logits, in place.
ApplyMask = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_executor: llguidance.LLExecutor | None = None
_buffers: dict[tuple[str, int], _Buffer] = {}
_lock = threading.Lock()


class _Buffer:
    """A pinned host bitmask reused across steps, and the copy that last read it."""

    def __init__(self, rows: int, words: int, pin: bool) -> None:
        self.host = torch.full((rows, words), -1, dtype=torch.int32, pin_memory=pin)
        self.copied: torch.cuda.Event | None = None


def _get_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    return _executor


def _buffer(device: torch.device, rows: int, words: int) -> _Buffer:
    key = (str(device), words)
    buf = _buffers.get(key)
    if buf is None or buf.host.shape[0] < rows:
        size = max(rows, 2 * buf.host.shape[0] if buf is not None else 64)
        buf = _buffers[key] = _Buffer(size, words, device.type == "cuda")
    if buf.copied is not None:
        buf.copied.synchronize()  # the last step's copy has long finished; never overwrite it
    return buf


def mask_logits(rows: Sequence[MaskRow], logits: torch.Tensor, apply: ApplyMask) -> torch.Tensor:
    """Apply the constrained jobs' masks to their rows of logits [N, V] (in place; returns
    logits). A job whose grammar allows no token at a row is marked failed (its row is left
    open: `sync_constraint` ends the job before its token is used)."""
    wanted = [
        (row[0].constraint, row[1], row[2])
        for row in rows
        if getattr(row[0], "constraint", None) is not None and row[0].constraint.failed is None
    ]
    if not wanted:
        return logits
    with _lock:
        return _mask(wanted, logits, apply)


def _mask(
    wanted: list[tuple[Any, int, Sequence[int]]], logits: torch.Tensor, apply: ApplyMask
) -> torch.Tensor:
    words = (wanted[0][0].vocab + 31) // 32
    count = sum(1 + len(drafts) for _, _, drafts in wanted)
    buf = _buffer(logits.device, count, words)
    host = buf.host
    targets: list[int] = []
    plain: list[tuple[Any, int]] = []
    at = 0
    for constraint, first, drafts in wanted:
        if drafts:
            # Speculative rows: the mask after each accepted draft (they were trimmed to
            # what the grammar allows), then back to where the job is.
            matcher = constraint.matcher
            for j in range(len(drafts) + 1):
                llguidance.torch.fill_next_token_bitmask(matcher, host, at + j)
                if j < len(drafts) and not matcher.consume_token(drafts[j]):
                    break
            matcher.rollback(min(j, len(drafts)))
        else:
            plain.append((constraint.matcher, at))
        targets.extend(range(first, first + 1 + len(drafts)))
        at += 1 + len(drafts)
    if len(plain) > 1:
        llguidance.torch.fill_next_token_bitmask_par(_get_executor(), plain, host[:at])
    elif plain:
        llguidance.torch.fill_next_token_bitmask(plain[0][0], host, plain[0][1])
    at = 0
    for constraint, _, drafts in wanted:
        first_mask = host[at]
        if constraint.matcher.is_error() or not bool(first_mask.any()):
            detail = constraint.matcher.get_error().split("\n", 1)[0][:200]
            constraint.fail(f"the grammar allows no token here ({detail or 'empty mask'})")
            host[at : at + 1 + len(drafts)] = -1
        at += 1 + len(drafts)
    if logits.shape[1] > words * 32:
        raise ValueError(f"logits have {logits.shape[1]} tokens, the masks {words * 32}")
    device = logits.device
    mask = host[:at]
    rows_at = torch.tensor(targets, dtype=torch.int64)
    if device.type == "cuda":
        mask = mask.to(device, non_blocking=True)
        rows_at = rows_at.pin_memory().to(device, non_blocking=True)
        buf.copied = torch.cuda.Event()
        buf.copied.record(torch.cuda.current_stream(device))
    return apply(logits, mask, rows_at)


def trim_drafts(job: Any, drafts: list[int]) -> list[int]:
    """`drafts` cut before the first one the job's grammar refuses."""
    constraint = getattr(job, "constraint", None)
    if constraint is None or not drafts:
        return drafts
    return drafts[: constraint.valid_prefix(drafts)]


def sync_constraint(job: Any, generated: list[int]) -> str | None:
    """Bring the job's matcher to its `generated` tokens; CONSTRAINT_ERROR when the job
    cannot go on (its grammar allowed no token, or a token it was given broke it)."""
    constraint = getattr(job, "constraint", None)
    if constraint is None:
        return None
    constraint.sync(generated)
    return CONSTRAINT_ERROR if constraint.failed is not None else None
