"""What each kernel costs a decode step when kernels overlap (programmatic dependent launch).

    python tools/critical_path.py TRACE [--skip 3] [--top 25] [--json OUT]

TRACE: a chrome trace of decode steps from torch.profiler (tools/profile_tp_decode.py's
<out>/tp_profile-*.trace.json, tools/profile_decode.py's), optionally gzipped.

Under PDL a kernel launches while its predecessor still runs and waits inside itself, so its
duration says nothing about what it costs: a 30 µs all-reduce may be 25 µs of waiting for
the GEMV before it. Here each GPU event (kernel, memcpy, memset), taken in start order, is
charged only the time by which it moved the stream's running end forward:

    charge(e) = max(0, end(e) - max(end of every event that started before e))

so the charges of a step add up to its length from the first event's end, idle gaps
included (a gap is charged to the event after it: on the step's first kernels it is the
host's lateness). Steps are split at the sampler's argmax kernel (one per decode step); the
first --skip steps are left out (graph warm-up). Prints per kernel name: µs per step, calls
per step, µs per call, largest first. --by-grid keys each kernel by its name and launch grid
too, so that one kernel's calls at different shapes (a layer's four GEMVs) are told apart.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# The last kernel of a step's argmax: kernels/argmax.py's row kernel where the runner's
# argmax draws, torch's reduce elsewhere (a trace has one kind or the other). A greedy job's
# step runs it once; a sampled row's draw runs it twice, which would split its steps in two,
# so profile greedy jobs (tools/profile_tp_decode.py does).
STEP_MARKS = ("_argmax_rows_kernel", "ArgMax")


@dataclass
class Attribution:
    """Charges per kernel name over `steps` decode steps (µs in total, calls in total)."""

    steps: int = 0
    step_us: list[float] = field(default_factory=list)
    idle_us: float = 0.0
    charge_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def rows(self, top: int) -> list[dict[str, Any]]:
        """The `top` largest charges: name, µs per step, calls per step, µs per call."""
        ranked = sorted(self.charge_us.items(), key=lambda kv: -kv[1])[:top]
        return [
            {
                "kernel": name,
                "us_per_step": us / self.steps,
                "calls_per_step": self.calls[name] / self.steps,
                "us_per_call": us / self.calls[name],
            }
            for name, us in ranked
        ]


def device_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace's GPU events (complete events of the device categories) in start order."""
    events = [
        e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
    ]
    return sorted(events, key=lambda e: e["ts"])


def short_name(name: str) -> str:
    """A kernel's name without template arguments' noise: NCCL kernels by collective."""
    if name.startswith("ncclDevKernel_"):
        return "nccl " + name.split("(")[0][len("ncclDevKernel_") :]
    return name[:60]


def event_key(event: dict[str, Any], by_grid: bool) -> str:
    """The row an event is charged to: its short name, with its launch grid (torch.profiler's
    args.grid, kernels only) when `by_grid`."""
    name = short_name(event["name"])
    grid = event.get("args", {}).get("grid") if by_grid else None
    return f"{name} grid={list(grid)}" if grid else name


def attribute(events: list[dict[str, Any]], skip: int = 3, by_grid: bool = False) -> Attribution:
    """Charge every event between consecutive step marks (see the module docstring)."""
    mark = next((m for m in STEP_MARKS if any(m in e["name"] for e in events)), STEP_MARKS[0])
    marks = [i for i, e in enumerate(events) if mark in e["name"]]
    result = Attribution()
    for first, last in zip(marks[skip:], marks[skip + 1 :], strict=False):
        step = events[first : last + 1]
        end = step[0]["ts"] + step[0]["dur"]
        result.step_us.append(step[-1]["ts"] + step[-1]["dur"] - end)
        for event in step[1:]:
            event_end = event["ts"] + event["dur"]
            result.idle_us += max(0.0, event["ts"] - end)
            name = event_key(event, by_grid)
            result.charge_us[name] += max(0.0, event_end - end)
            result.calls[name] += 1
            end = max(end, event_end)
        result.steps += 1
    if result.steps == 0:
        raise ValueError(
            f"fewer than {skip + 2} {' or '.join(STEP_MARKS)} kernels in the trace: no decode "
            "step to attribute (lower --skip, or profile more steps)"
        )
    return result


def load_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace: dict[str, Any] = json.load(f)
    return trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--skip", type=int, default=3, help="first steps left out (warm-up)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", type=Path, help="also write the table here")
    p.add_argument("--by-grid", action="store_true", help="one row per kernel and launch grid")
    args = p.parse_args()
    result = attribute(device_events(load_trace(args.trace)), args.skip, args.by_grid)
    rows = result.rows(args.top)
    median = statistics.median(result.step_us)
    print(
        f"{result.steps} steps, median step {median:.1f} µs, "
        f"idle {result.idle_us / result.steps:.1f} µs/step (inside the charges below)"
    )
    print(f"{'µs/step':>9} {'n/step':>7} {'µs each':>8}  kernel")
    for row in rows:
        print(
            f"{row['us_per_step']:9.1f} {row['calls_per_step']:7.1f} "
            f"{row['us_per_call']:8.2f}  {row['kernel']}"
        )
    if args.json:
        summary = {
            "trace": str(args.trace),
            "steps": result.steps,
            "median_step_us": median,
            "idle_us_per_step": result.idle_us / result.steps,
            "kernels": rows,
        }
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
