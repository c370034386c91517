"""RMSNorm folded into the decode GEMVs in the engine (issue 28, engine/norm_fold.py): greedy
decode of a tiny quantized model gives the same tokens and the same logits bit for bit with
the fold on and off, and one decode step launches 2 * layers - 1 kernels fewer (each layer's
two add_rms_norm launches, minus the first layer's input norm, which stays a kernel). The
kernels' own bit-equality tests, on the CPU too, are tests/kernels/test_norm_fold.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.cache import ForwardBatch, Sequence
from engine.engine import Engine, EngineOptions
from engine.norm_fold import set_norm_fold
from helpers.decoding import greedy_with_logits
from tools.bench import build_model


def _engine(model: Path, graphs: bool) -> Engine:
    options = EngineOptions(
        device="cuda", dtype="float16", max_seq_len=256, cache_tokens=1024, cuda_graphs=graphs
    )
    return Engine.load(model, options)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_decode_is_the_same_with_the_fold_on_and_off(
    fmt: str, graphs: bool, tmp_path: Path
) -> None:
    model = build_model(tmp_path / fmt, "tiny", fmt)
    prompt = torch.randint(2, 1000, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    results = {}
    try:
        for enabled in (False, True):
            set_norm_fold(enabled)
            engine = _engine(model, graphs)
            try:
                results[enabled] = greedy_with_logits(engine, prompt, 24)
            finally:
                engine.unload()
    finally:
        set_norm_fold(True)
    assert results[True][0] == results[False][0]
    assert torch.equal(results[True][1], results[False][1])


def _kernels_per_step(engine: Engine) -> int:
    seq = Sequence()
    token = int(engine.runner.prefill(seq, list(range(2, 30)))[-1].argmax())

    def step() -> None:
        seq.reserve(engine.cache, seq.length + 1)
        engine.model(ForwardBatch.build(engine.cache, [seq], [[token]]), engine.cache)

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(
        e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
    )


@pytest.mark.gpu
def test_the_fold_removes_two_norm_launches_per_layer(tmp_path: Path) -> None:
    model = build_model(tmp_path / "gptq", "tiny", "gptq")
    counts = {}
    try:
        for enabled in (False, True):
            set_norm_fold(enabled)
            engine = _engine(model, graphs=False)
            try:
                layers = len(engine.model.model.layers)
                counts[enabled] = _kernels_per_step(engine)
            finally:
                engine.unload()
    finally:
        set_norm_fold(True)
    assert counts[False] - counts[True] == 2 * layers - 1, counts
