"""How many mask lanes (threads that compute token masks side by side) this process uses.

A lane is a set of jobs whose matchers share one lexer (engine/constraints/compiler.py
says why); the masks of one lane are computed one after another on one thread, different
lanes in parallel (engine/constraints/hooks.py). `KESTREL_MASK_THREADS` sets the count;
by default three quarters of the CPUs this process may run on, at most 16 (a step rarely
has more constrained rows than that per lane's worth of work, and each lane keeps its own
lexer per grammar). One lane computes masks on the scheduler's thread, with no pool.
"""

from __future__ import annotations

import os

MAX_LANES = 16
ENV = "KESTREL_MASK_THREADS"

_override: int | None = None


def mask_lanes() -> int:
    """The number of mask lanes: set_mask_lanes's, else KESTREL_MASK_THREADS, else by CPUs."""
    if _override is not None:
        return _override
    text = os.environ.get(ENV, "").strip()
    if text:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{ENV} must be a whole number of threads, got {text!r}") from None
        if not 1 <= value <= 256:
            raise ValueError(f"{ENV} must be between 1 and 256, got {value}")
        return value
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_LANES, (cpus or 1) * 3 // 4))


def set_mask_lanes(lanes: int | None) -> None:
    """Use `lanes` lanes from now on (None: back to the default). Jobs already made keep
    their lane; tools/bench_masks.py and the tests compare lane counts in one process."""
    global _override
    if lanes is not None and not 1 <= lanes <= 256:
        raise ValueError(f"mask lanes must be between 1 and 256, got {lanes}")
    _override = lanes
