"""Programmatic dependent launch (kernels/backend.py): when it is used, and that a decode
step's kernels overlapping their predecessors changes nothing the model computes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kernels.backend as backend
from engine.engine import Engine, EngineOptions
from helpers.decoding import greedy_with_logits
from tools.bench import build_model


@pytest.fixture
def restore_switch() -> Iterator[None]:
    before = backend._PROGRAMMATIC_LAUNCH
    yield
    backend.set_programmatic_launch(before)


def test_never_on_cpu_tensors(restore_switch: None) -> None:
    # The interpreter and the torch path have no launch to relax, whatever the switch says.
    backend.set_programmatic_launch(True)
    assert backend.programmatic_launch(torch.zeros(1)) is False
    backend.set_programmatic_launch(False)
    assert backend.programmatic_launch(torch.zeros(1)) is False


@pytest.mark.gpu
def test_follows_the_switch_and_the_device(restore_switch: None) -> None:
    x = torch.zeros(1, device="cuda")
    backend.set_programmatic_launch(False)
    assert backend.programmatic_launch(x) is False
    backend.set_programmatic_launch(True)
    hopper = torch.cuda.get_device_capability(x.device)[0] >= 9
    assert backend.programmatic_launch(x) is hopper


def _greedy(path: Path, pdl: bool, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    backend.set_programmatic_launch(pdl)
    options = EngineOptions(device="cuda", dtype="float16", max_seq_len=256)
    engine = Engine.load(path, options)
    assert engine.graphs is not None  # the launches under test are the captured ones
    try:
        return greedy_with_logits(engine, prompt, steps)
    finally:
        engine.unload()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
def test_decode_is_the_same_with_and_without(
    fmt: str, tmp_path: Path, restore_switch: None
) -> None:
    """Greedy decode through CUDA graphs of a quantized model (GEMVs, norms, RoPE + cache
    write, split attention and its merge all launched with PDL) against the same engine
    without PDL. A kernel reading its input before its predecessor finished would show as
    different tokens or logits. Split-K sums are added in a fixed slot order (issue 31), so
    the two must agree bit for bit."""
    path = build_model(tmp_path / fmt, "tiny", fmt)
    prompt = torch.randint(2, 4096, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    plain_tokens, plain_rows = _greedy(path, False, prompt, 24)
    pdl_tokens, pdl_rows = _greedy(path, True, prompt, 24)
    assert pdl_tokens == plain_tokens
    assert torch.equal(pdl_rows, plain_rows)
