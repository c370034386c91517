"""Models whose activations leave float16's range (Gemma 2 and 3) run in bfloat16 on a GPU
unless asked otherwise, and the converter's calibration forward runs them in float32.

Gemma-3-270M, the UI's default model, reaches 103,792 in its residual stream at <bos>
(float32, transformers): in float16 every logit was NaN and every reply empty on a GPU,
and the converter's Hessians NaN ("not positive definite even with damping"). The real
model's numbers are checked in tests/loader/test_real_models.py; these tests hold the
choices made from the architecture, on tiny models."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.loading import auto_dtype, overflows_float16, resolve_dtype
from engine.quantizer.model import LayerwiseModel
from engine.quantizer.pipeline import ConvertError, _check_finite, forward_dtype
from helpers.architectures import CASES
from helpers.model_factory import make_tiny_llama, make_tiny_model

CUDA = torch.device("cuda", 0)  # only named: the choices below read configs, not the GPU


def _model(path: Path, case: str) -> Path:
    if case == "llama":
        make_tiny_llama(path)
    else:
        config_cls, overrides, _ = CASES[case]
        make_tiny_model(path, config_cls, **overrides)
    return path


@pytest.mark.parametrize(
    ("case", "overflows"),
    [("llama", False), ("gemma2", True), ("gemma3", True), ("qwen3", False)],
)
def test_the_architecture_says_whether_float16_overflows(
    tmp_path: Path, case: str, overflows: bool
) -> None:
    path = _model(tmp_path, case)
    assert overflows_float16(ModelConfig.from_dir(path).architecture) is overflows
    # The converter's calibration forward on a GPU: float16, or float32 where it overflows.
    assert forward_dtype(path, CUDA) == (torch.float32 if overflows else torch.float16)
    assert forward_dtype(path, torch.device("cpu")) == torch.float32


def test_auto_is_float32_on_the_cpu_whatever_the_model() -> None:
    cpu = torch.device("cpu")
    assert auto_dtype(cpu) == auto_dtype(cpu, overflows_float16=True) == torch.float32
    assert resolve_dtype("auto", cpu, overflows_float16=True) == torch.float32
    assert resolve_dtype(None, cpu) == torch.float32


def test_float16_asked_for_an_overflowing_model_is_given_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="engine.loading"):
        assert resolve_dtype("float16", cpu) == torch.float16
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="engine.loading"):
        assert resolve_dtype("float16", cpu, overflows_float16=True) == torch.float16
        assert resolve_dtype("bfloat16", cpu, overflows_float16=True) == torch.bfloat16
    assert len(caplog.records) == 1
    assert "exceed float16's range" in caplog.records[0].getMessage()
    assert "bfloat16" in caplog.records[0].getMessage()


@pytest.mark.parametrize("loader_name", ["kestrel", "transformers"])
@pytest.mark.parametrize(("case", "warned"), [("gemma3", True), ("llama", False)])
def test_each_loader_asks_the_architecture(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str, warned: bool, loader_name: str
) -> None:
    import loader

    path = _model(tmp_path, case)
    options = {"max_seq_len": 64} if loader_name == "kestrel" else {}
    with caplog.at_level(logging.WARNING, logger="engine.loading"):
        m = loader.load(path, loader_name, device="cpu", dtype="float16", **options)
    try:
        assert m.info()["dtype"] == "float16"  # what was asked for, warned or not
    finally:
        m.unload()
    assert any("exceed float16's range" in r.getMessage() for r in caplog.records) is warned


def test_the_converter_stops_at_a_layer_whose_output_is_not_finite(tmp_path: Path) -> None:
    lm = LayerwiseModel(_model(tmp_path, "llama"), device=torch.device("cpu"), dtype=torch.float16)
    states = torch.zeros(2, 8, lm.config.hidden_size, dtype=torch.float16)
    _check_finite(lm, 3, states)  # finite: nothing to say
    states[1, 5, 7] = float("inf")
    with pytest.raises(ConvertError, match=r"layer 3 of .*not finite in float16.*--device cpu"):
        _check_finite(lm, 3, states)
    states[1, 5, 7] = float("nan")
    with pytest.raises(ConvertError, match="layer 3"):
        _check_finite(lm, 3, states)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_a_gpu_is_bfloat16_for_an_overflowing_model() -> None:
    native_bf16 = torch.cuda.get_device_capability(0)[0] >= 8
    assert auto_dtype(CUDA) == torch.float16
    assert auto_dtype(CUDA, overflows_float16=True) == (
        torch.bfloat16 if native_bf16 else torch.float32
    )
