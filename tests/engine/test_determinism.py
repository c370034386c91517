"""Decode is bitwise reproducible on one GPU, always: the same prompt, settings and seed
give the same tokens and the same logits in every run and every process (issue 31).

Each program of the split-K GEMVs and of the mid-M matmul stores its partial in its own
workspace slot and the last program of a tile adds the slots in slot order
(kernels/quant_matmul/tiles.py), so the order in which programs finish cannot change a bit.
These tests run the same decode in fresh processes (kernels compiled anew, new CUDA graphs,
a new workspace) and compare everything bit for bit, at batch 1 (the GEMV) and batch 8 (the
tensor-core path), greedy and seeded sampling mixed in one batch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.bench import build_model

ROOT = Path(__file__).resolve().parents[2]
# Run as a module from the checkout's root: the probe imports the engine and its sibling helper.
PROBE = "tests.helpers.determinism_probe"
PROCESSES = 3


def _probe(model: Path, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", PROBE, str(model), str(out)], check=True, cwd=ROOT)
    return torch.load(out)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
def test_decode_is_bitwise_the_same_in_fresh_processes(fmt: str, tmp_path: Path) -> None:
    model = build_model(tmp_path / fmt, "tiny", fmt)
    runs = [_probe(model, tmp_path / f"run{i}.pt") for i in range(PROCESSES)]
    first = runs[0]
    assert first["greedy_logits"].isfinite().all()
    assert len(first["batch8"]) == 8 and all(len(job["ids"]) > 0 for job in first["batch8"])
    for i, run in enumerate(runs[1:], start=1):
        assert torch.equal(run["greedy_logits"], first["greedy_logits"]), (
            f"process {i}: batch-1 logits differ from process 0's"
        )
        for batch in ("batch1", "batch8"):
            for j, (job, want) in enumerate(zip(run[batch], first[batch], strict=True)):
                # Exact float equality: the log-probabilities come from the logits, so any
                # bit of difference upstream shows here.
                assert job == want, f"process {i}, {batch} job {j} differs from process 0's"


def test_the_loader_still_accepts_the_old_option(tmp_path: Path) -> None:
    """`deterministic=True` (the CLI's --deterministic) predates the fixed-order sums: it is
    still accepted, and changes nothing (decode is always deterministic)."""
    import loader
    from helpers.model_factory import make_tiny_llama

    make_tiny_llama(tmp_path / "tiny")
    settings = {"max_new_tokens": 3, "temperature": 0}
    model = loader.load(tmp_path / "tiny", "kestrel", device="cpu", deterministic=True)
    try:
        with_option = model.generate("hello", settings)
    finally:
        model.unload()
    model = loader.load(tmp_path / "tiny", "kestrel", device="cpu")
    try:
        assert model.generate("hello", settings) == with_option
    finally:
        model.unload()
