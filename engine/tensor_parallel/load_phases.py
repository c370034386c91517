"""Where a tensor-parallel load's time goes, rank by rank.

Each rank notes its phases (start-up and imports, reading and cutting its shard, moving it,
the cache, joining the group, the all-reduce set-up) as wall-clock spans. Rank 0 gathers
every rank's list once all are loaded (rank.exchange_rank_reports), and the engine keeps
them (`TensorParallelRunner.ranks.load_phases`): tools/profile_tp_load.py prints them, so a
slow load shows which rank waited for what. Times are seconds since rank 0 began the launch
for ranks this machine spawned (one clock), or since the rank's own start under torchrun
(machines' clocks differ).

Counts beside the spans (rank.load_rank): the weight files' bytes and read calls, read_s
(positioned reads, staging waits included), place_s (cast and finite check of dense
tensors), cut_plan_s, cut_s, repack_s (load_quantized_linear on the pieces read: the
move to the device of a piece read elsewhere, validation, repacking, the syncs those
force), shard_s, stage_buffers and stage_wait_s (engine/staged_reads.py), ahead_s (the
part of read_s and place_s spent on the quantized linears, by the read-ahead worker beside
the load's thread: engine/read_ahead.py) and ahead_wait_s (what those reads cost the load's
thread: its waits for them), and read_cut_other_s: the rest of the read-and-cut phase (the
quantized reads counted as ahead_wait_s), which ends with a device sync so that the copies
and kernels it queued are its own. A 70B TP=2 load had ~18 s of that
phase outside every counter: the quantized pieces' pageable copies to the GPU in
load_quantized_linear were timed by none (issue 33).

Nothing here imports torch: the spawned ranks note their start-up before importing it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class LoadPhases:
    """One rank's phases: (name, start, end) in seconds since `origin` (a time.time())."""

    origin: float = field(default_factory=time.time)
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    # Totals that are not spans: bytes and read calls of the weight files, and the like.
    counts: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, start: float, end: float) -> None:
        """A phase that ran from `start` to `end` (time.time() values)."""
        self.spans.append((name, round(start - self.origin, 4), round(end - self.origin, 4)))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start, time.time())

    def report(self) -> dict[str, object]:
        """What rank 0 gathers: picklable, small."""
        return {"spans": list(self.spans), **self.counts}


def format_phases(reports: list[dict[str, object]]) -> str:
    """A table of every rank's phases (rows: phases in the order rank 0 met them)."""
    lines = []
    for rank, report in enumerate(reports):
        spans = report.get("spans") or []
        assert isinstance(spans, list)
        lines.append(f"rank {rank}:")
        for name, start, end in spans:
            lines.append(f"  {name:<22} {start:8.2f} -> {end:8.2f} s  ({end - start:7.2f} s)")
        extra = {k: v for k, v in report.items() if k != "spans"}
        if extra:
            lines.append("  " + ", ".join(f"{k}={v}" for k, v in extra.items()))
    return "\n".join(lines)
