"""The scheduler's three hooks into constrained decoding (and the single-job loop's).

A step's masks are computed on the host after its forward was launched: the matchers
already consumed the tokens before it (`sync_constraint` runs as each job takes its
tokens), so the host works on the masks while the GPU computes the logits. They are
written into one pinned bitmask, copied to the device without a host sync and applied
there by the runner's `apply_token_bitmask` (kernels/token_bitmask.py: the scheduler
reaches no kernel code itself, so the device half is passed in). A job without a
constraint costs nothing; a step without one costs one attribute look-up per row.

Rows are filled lane by lane (engine/constraints/lanes.py): the jobs of one lane share a
lexer, which llguidance locks for each whole mask, so one thread fills a lane's rows and
the lanes run on a small thread pool side by side (llguidance releases the GIL while it
computes a mask). llguidance's own parallel executor hands rows to threads in any order:
rows sharing a lexer then wait on each other's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from engine.constraints.state import JobConstraint

# (job, first logits row, drafts): the job's rows are first_row .. first_row + len(drafts),
# row j drawn after the job's tokens and drafts[:j].
MaskRow = tuple[Any, int, Sequence[int]]
# (logits [N, V], bitmask [R, ceil(V / 32)] int32, rows [R] int64) -> logits, in place.
ApplyMask = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# A lane's rows: (constraint, its first row in the host bitmask, drafts).
_LaneRows = list[tuple[Any, int, Sequence[int]]]

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_buffers: dict[tuple[str, int], _Buffer] = {}
_lock = threading.Lock()


class _Buffer:
    """A pinned host bitmask and row index reused across steps, and the copy that last
    read them."""

    def __init__(self, rows: int, words: int, pin: bool) -> None:
        self.host = torch.full((rows, words), -1, dtype=torch.int32, pin_memory=pin)
        self.rows = torch.zeros(rows, dtype=torch.int64, pin_memory=pin)
        self.copied: torch.cuda.Event | None = None


def _get_pool(lanes: int) -> ThreadPoolExecutor:
    """A pool with a thread for each of `lanes` lanes (grown when more lanes show up)."""
    global _pool, _pool_size
    if _pool is None or _pool_size < lanes:
        if _pool is not None:
            _pool.shutdown(wait=False)
        _pool = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="kestrel-masks")
        _pool_size = lanes
    return _pool


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
        if getattr(row[0], "constraint", None) is not None and row[0].constraint.open
    ]
    if not wanted:
        return logits
    with _lock:
        return _mask(wanted, logits, apply)


def _fill_lane(rows: _LaneRows, base: int, row_bytes: int) -> None:
    """Compute one lane's masks into the host bitmask at `base` (one thread per lane)."""
    for constraint, at, drafts in rows:
        matcher = constraint.matcher
        if not drafts:
            matcher.unsafe_compute_mask_ptr(base + at * row_bytes, row_bytes)
            continue
        # Speculative rows: the mask after each accepted draft (they were trimmed to what
        # the grammar allows), then back to where the job is.
        for j in range(len(drafts) + 1):
            matcher.unsafe_compute_mask_ptr(base + (at + j) * row_bytes, row_bytes)
            if j < len(drafts) and not matcher.consume_token(drafts[j]):
                break
        matcher.rollback(min(j, len(drafts)))


def _mask(
    wanted: list[tuple[Any, int, Sequence[int]]], logits: torch.Tensor, apply: ApplyMask
) -> torch.Tensor:
    words = (wanted[0][0].vocab + 31) // 32
    if logits.shape[1] > words * 32:
        raise ValueError(f"logits have {logits.shape[1]} tokens, the masks {words * 32}")
    count = sum(1 + len(drafts) for _, _, drafts in wanted)
    buf = _buffer(logits.device, count, words)
    host = buf.host
    lanes: dict[int, _LaneRows] = {}
    targets: list[int] = []
    firsts: list[int] = []
    at = 0
    for constraint, first, drafts in wanted:
        lanes.setdefault(constraint.lane, []).append((constraint, at, drafts))
        targets.extend(range(first, first + 1 + len(drafts)))
        firsts.append(at)
        at += 1 + len(drafts)
    base, row_bytes = host.data_ptr(), words * 4
    groups = list(lanes.values())
    if len(groups) > 1:
        # The other lanes on the pool, the first on this thread meanwhile.
        pool = _get_pool(len(groups) - 1)
        others = [pool.submit(_fill_lane, group, base, row_bytes) for group in groups[1:]]
        try:
            _fill_lane(groups[0], base, row_bytes)
        finally:
            wait(others)  # none may still write into the buffer once this step is over
        for future in others:
            future.result()
    else:
        _fill_lane(groups[0], base, row_bytes)
    # One look at every job's first row: a job whose grammar allows nothing fails.
    allowed: list[bool] = np.asarray(host.numpy()[firsts].any(axis=1)).tolist()
    for (constraint, _, drafts), at_first, ok in zip(wanted, firsts, allowed, strict=True):
        matcher = constraint.matcher
        broken = matcher.is_error()
        if not broken and matcher.is_stopped():
            if _allows_any(host[at_first], constraint.stop_ids):
                continue  # it ends on a stop token, as any job does
            # The grammar has ended and leaves only EOS, which this job bans (ban_eos_token):
            # the grammar's end is the job's.
            constraint.complete = True
        elif ok and not broken:
            continue
        else:
            detail = matcher.get_error().split("\n", 1)[0][:200]
            constraint.fail(f"the grammar allows no token here ({detail or 'empty mask'})")
        host[at_first : at_first + 1 + len(drafts)] = -1
    mask = host[:at]
    if logits.device.type == "cuda":
        rows_at = buf.rows[:at]
        rows_at.numpy()[:] = targets
        device = logits.device
        mask = mask.to(device, non_blocking=True)
        rows_at = rows_at.to(device, non_blocking=True)
        buf.copied = torch.cuda.Event()
        buf.copied.record(torch.cuda.current_stream(device))
    else:
        rows_at = torch.tensor(targets, dtype=torch.int64)
    return apply(logits, mask, rows_at)


def _allows_any(row: torch.Tensor, tokens: frozenset[int]) -> bool:
    """Whether a bitmask row (int32 words, bit t of word t // 32 for token t) allows any of
    `tokens`."""
    words = row.numpy()
    return any((int(words[t >> 5]) >> (t & 31)) & 1 for t in tokens if t >> 5 < len(words))


def trim_drafts(job: Any, drafts: list[int]) -> list[int]:
    """`drafts` cut before the first one the job's grammar refuses."""
    constraint = getattr(job, "constraint", None)
    if constraint is None or not drafts:
        return drafts
    return drafts[: constraint.valid_prefix(drafts)]


def sync_constraint(job: Any, generated: list[int]) -> str | None:
    """Bring the job's matcher to its `generated` tokens; the finish reason when the job
    cannot go on: CONSTRAINT_ERROR (its grammar allowed no token, or a token it was given
    broke it) or GRAMMAR_COMPLETE (its grammar ended with no stop token open)."""
    constraint: JobConstraint | None = getattr(job, "constraint", None)
    if constraint is None:
        return None
    constraint.sync(generated)
    return constraint.finish_reason()
