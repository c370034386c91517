"""tools/critical_path.py on hand-made chrome traces: what an overlapped kernel is charged."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.critical_path import attribute, device_events, load_trace


def _kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def _step(t0: float, argmax: str = "void at::native::reduce_kernel<ArgMax>") -> list[dict]:
    """One decode step after the previous step's argmax (which ends at t0), 19 µs long:
    a 4 µs gap (the host), a GEMV 10 µs, an all-reduce launched early under PDL that ends
    3 µs after the GEMV, a norm wholly inside the all-reduce, the argmax 2 µs."""
    return [
        _kernel("_gemv_kernel", t0 + 4, 10),  # ends t0+14
        _kernel("_tp_push_all_reduce_kernel", t0 + 9, 8),  # ends t0+17: charged 3
        _kernel("_rms_norm_kernel", t0 + 10, 2),  # inside: charged 0
        _kernel(argmax, t0 + 17, 2),  # ends t0+19
    ]


def _trace(steps: int, argmax: str = "void at::native::reduce_kernel<ArgMax>") -> dict:
    events = [_kernel(argmax, 0, 1)]
    t = 1.0
    for _ in range(steps):
        events += _step(t, argmax)
        t += 19  # the step's argmax ends 19 µs after the previous one
    # Host-side events and instant events are not GPU work: ignored.
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 3, "dur": 50})
    events.append({"ph": "i", "cat": "kernel", "name": "marker", "ts": 5})
    return {"traceEvents": events}


@pytest.mark.parametrize(
    "argmax", ["void at::native::reduce_kernel<ArgMax>", "_argmax_parts_kernel|_argmax_rows_kernel"]
)
def test_an_overlapped_kernel_is_charged_only_what_it_adds(argmax: str) -> None:
    """Steps end at torch's argmax reduce, or at kernels/argmax.py's row kernel."""
    if "|" in argmax:  # the two-kernel argmax: its part kernel runs first in the step
        parts, argmax = argmax.split("|")
        trace = _trace(5, argmax)
        part_kernels = [
            _kernel(parts, e["ts"] - 0.5, 0.5)
            for e in trace["traceEvents"]
            if e["name"] == argmax and e["ts"] > 0
        ]
        trace["traceEvents"] = sorted(
            trace["traceEvents"] + part_kernels, key=lambda e: e.get("ts", 0)
        )
    else:
        trace = _trace(5, argmax)
    result = attribute(device_events(trace), skip=1)
    assert result.steps == 4
    assert result.step_us == [19.0] * 4
    rows = {r["kernel"]: r for r in result.rows(10)}
    assert rows["_gemv_kernel"]["us_per_call"] == pytest.approx(14.0)  # its 10 + the 4 µs gap
    assert rows["_tp_push_all_reduce_kernel"]["us_per_step"] == pytest.approx(3.0)
    assert rows["_rms_norm_kernel"]["us_per_step"] == 0.0
    assert rows["_rms_norm_kernel"]["calls_per_step"] == 1.0
    assert result.idle_us / result.steps == pytest.approx(4.0)
    # The charges of a step add up to the step.
    assert sum(r["us_per_step"] for r in rows.values()) == pytest.approx(19.0)
    assert "aten::mm" not in rows and "marker" not in rows


def test_by_grid_tells_one_kernels_shapes_apart() -> None:
    """Two GEMVs of one step, different grids: one row each with --by-grid, one row without."""
    trace = _trace(3)
    for event in trace["traceEvents"]:
        if event["name"] == "_gemv_kernel":
            event["args"] = {"grid": [80, 4, 1]}
    trace["traceEvents"].insert(2, {**_kernel("_gemv_kernel", 0, 0.5), "args": {"grid": [8, 1, 1]}})
    plain = {r["kernel"] for r in attribute(device_events(trace), skip=1).rows(10)}
    split = {r["kernel"] for r in attribute(device_events(trace), skip=1, by_grid=True).rows(10)}
    assert "_gemv_kernel" in plain and not any("grid" in k for k in plain)
    assert "_gemv_kernel grid=[80, 4, 1]" in split and "_gemv_kernel" not in split
    # Events without a grid (the hand-made norm here) keep their plain name.
    assert "_rms_norm_kernel" in split


def test_too_few_steps_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no decode step"):
        attribute(device_events(_trace(2)), skip=3)


def test_the_command_reads_a_gzipped_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(6), f)
    assert len(device_events(load_trace(path))) == 1 + 6 * 4
    out = tmp_path / "cp.json"
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "tools/critical_path.py", str(path), "--skip", "2", "--json", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "4 steps, median step 19.0" in run.stdout  # 6 steps, the first 2 skipped
    summary = json.loads(out.read_text())
    assert summary["kernels"][0]["kernel"] == "_gemv_kernel"
    assert summary["idle_us_per_step"] == pytest.approx(4.0)
