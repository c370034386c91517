"""With EngineOptions.deterministic, decode is bitwise reproducible on one GPU: the same
prompt, settings and seed give the same tokens and the same logits in every run and every
process (issue 31).

The split-K GEMVs and the mid-M matmul sum their partials as fixed-point integers for
float16 outputs (kernels/quant_matmul/tiles.py), so the order in which programs finish cannot
change a bit. These tests run the same decode in fresh processes (kernels compiled anew,
new CUDA graphs, a new workspace) and compare everything bit for bit, at batch 1 (the GEMV)
and batch 8 (the tensor-core path), greedy and seeded sampling mixed in one batch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.bench import build_model

PROBE = Path(__file__).resolve().parent / "determinism_probe.py"
PROCESSES = 3


def _probe(model: Path, out: Path) -> dict:
    subprocess.run([sys.executable, str(PROBE), str(model), str(out)], check=True)
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


def test_the_loader_option_sets_the_kernels_switch(tmp_path: Path) -> None:
    """`deterministic=True` reaches the kernels through the public loader (and the CLI's
    --deterministic), set before any kernel runs; the next load without it turns it off."""
    import kernels.backend as backend
    import loader

    from model_factory import make_tiny_llama

    make_tiny_llama(tmp_path / "tiny")
    before = backend.deterministic_sums()
    try:
        model = loader.load(tmp_path / "tiny", "kestrel", device="cpu", deterministic=True)
        assert backend.deterministic_sums()
        assert model.generate("hello", {"max_new_tokens": 3, "temperature": 0})
        model.unload()
        loader.load(tmp_path / "tiny", "kestrel", device="cpu").unload()
        assert not backend.deterministic_sums()
    finally:
        backend.set_deterministic_sums(before)
