"""tools/soak.py on the CPU: a short soak of the real API server with a tiny random Llama (8
streaming clients, random lengths and disconnects, a cache small enough to preempt), and its
leak check failing when a page is held outside the scheduler. The GPU soak (64 clients, 10
minutes, the 8B-shaped model) is the same tool with other arguments (see its docstring)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import loader
from helpers.model_factory import make_tiny_llama
from tools import soak


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("soak") / "tiny"
    make_tiny_llama(path)
    return path


def test_short_cpu_soak_passes_and_reports_latency(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    status = soak.main([
        "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
        "--clients", "8", "--duration", "8", "--max-prompt", "64", "--max-tokens", "32",
        "--cancel-rate", "0.3", "--max-seq-len", "128", "--cache-tokens", "128",
        "--page-size", "16", "--json", str(out),
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert status == 0, report["failures"]
    assert report["ok"] and report["errors"] == 0 and report["failures"] == []
    assert report["finished"] >= 8 and report["cancelled"] >= 1, report
    assert report["pages"]["free_after"] == report["pages"]["usable"] == 8
    # 8 clients with jobs of up to 96 tokens (6 pages) share 8 pages: any two that decode at
    # once outgrow the cache (with 16 pages, a slow CI run once saw no preemption).
    assert report["pages"]["preemptions"] > 0
    for key in ("p50", "p90", "p99"):
        assert report["ttft_ms"][key] > 0
    assert report["time_per_output_token_ms"]["p50"] > 0 and report["tok_s_aggregate"] > 0
    assert report["ttft_ms"]["p50"] <= report["ttft_ms"]["p99"]


def test_leak_check_fails_on_a_held_page(model_dir: Path) -> None:
    model = loader.load(model_dir, "kestrel", device="cpu", dtype="float32", cache_tokens=512)
    try:
        cache = model.backend.cache
        assert soak.page_failures(soak.wait_idle(model, 1)) == []
        held = cache.allocate(2)  # as a request that leaked its pages would
        failures = soak.page_failures(soak.wait_idle(model, 1))
        assert failures and "2 of" in failures[0] and "still in use" in failures[0]
        cache.release(held)
    finally:
        model.unload()


def test_percentile() -> None:
    assert soak.percentile([], 50) is None
    assert soak.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert soak.percentile([0.0, 10.0], 90) == pytest.approx(9.0)
