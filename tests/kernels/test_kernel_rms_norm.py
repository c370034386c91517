"""kernels.rms_norm: the Triton kernel against the torch reference, the reference against
float64 math, and the dispatcher's backend choice (also kernels.backend's checks)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from kernels import rms_norm
from kernels.backend import resolve_backend
from kernels.rms_norm import rms_norm_reference, rms_norm_triton

# `kernels.rms_norm` the attribute is the op; the module is needed for monkeypatching.
rms_norm_module = importlib.import_module("kernels.rms_norm")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [
    (1, 72),
    (6, 576),  # SmolLM2-135M
    (3, 4100),
    (2, 3, 5, 64),  # leading [batch, seq, heads], e.g. a per-head q/k norm
    (2, 8192),  # Llama-3-70B
    (2, 20000),  # past the single-pass limit: the looped kernel
]
EPS = 1e-6


def _require_triton(device: str) -> None:
    # One process is either interpreted or compiled (triton.jit decides at import): on a GPU
    # machine the interpreter is off, so the Triton path cannot take CPU tensors there.
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (unset on GPU machines)")


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-6}
    # Two ulps relative; the atol covers float16 subnormals.
    return {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-6}


def _inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    *,
    weight_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(shape, generator=generator)
    weight = 1 + 0.5 * torch.randn(shape[-1], generator=generator)
    return x.to(device, dtype), weight.to(device, weight_dtype or dtype)


def _float64_rms_norm(x: torch.Tensor, weight: torch.Tensor, unit_offset: bool) -> torch.Tensor:
    x64, w64 = x.double(), weight.double()
    normed = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + EPS)
    return normed * (1 + w64 if unit_offset else w64)


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference(
    device: str, shape: tuple[int, ...], dtype: torch.dtype, unit_offset: bool
) -> None:
    _require_triton(device)
    x, weight = _inputs(shape, dtype, device, seed=sum(shape))
    expected = rms_norm(x, weight, EPS, unit_offset=unit_offset, backend="torch")
    actual = rms_norm(x, weight, EPS, unit_offset=unit_offset, backend="triton")
    assert actual.shape == x.shape and actual.dtype == expected.dtype == dtype
    torch.testing.assert_close(actual, expected, **_tolerance(dtype))


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 72), (2, 3, 576), (2, 4100)])
def test_reference_matches_float64(
    device: str, shape: tuple[int, ...], dtype: torch.dtype, unit_offset: bool
) -> None:
    x, weight = _inputs(shape, dtype, device, seed=1)
    actual = rms_norm_reference(x, weight, EPS, unit_offset=unit_offset)
    expected = _float64_rms_norm(x, weight, unit_offset)
    # Llama rounds twice (y, then y * weight): allow a couple of ulps of the output dtype.
    torch.testing.assert_close(actual.double(), expected, **_tolerance(dtype))


def test_reference_follows_llama_cast_order() -> None:
    # bf16: y is rounded before the weight multiply, so the result differs from rounding once.
    x, weight = _inputs((8, 576), torch.bfloat16, "cpu", seed=2)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    assert torch.equal(rms_norm_reference(x, weight, EPS), weight * y.to(torch.bfloat16))
    assert not torch.equal(rms_norm_reference(x, weight, EPS), (weight.float() * y).bfloat16())


def test_noncontiguous_inputs(device: str) -> None:
    _require_triton(device)
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(6, 10, 72, generator=generator).to(device, torch.float16)
    transposed = torch.randn(6, 72, 10, generator=generator).to(device, torch.float16)
    weight = torch.randn(72, generator=generator).to(device, torch.float16)
    views = {
        "strided rows": base[:, :4].reshape(-1, 72)[::2],
        "strided leading dims": base[::2, 1::3],
        "strided last dim": transposed.transpose(1, 2),
    }
    for name, x in views.items():
        assert not x.is_contiguous(), name
        expected = rms_norm_reference(x.contiguous(), weight, EPS)
        actual = rms_norm_triton(x, weight, EPS)
        assert actual.is_contiguous(), name
        torch.testing.assert_close(actual, expected, **_tolerance(x.dtype), msg=name)


@pytest.mark.parametrize("unit_offset", [False, True])
def test_float32_weight_with_bfloat16_activations(device: str, unit_offset: bool) -> None:
    _require_triton(device)
    x, weight = _inputs((5, 576), torch.bfloat16, device, weight_dtype=torch.float32, seed=4)
    expected = rms_norm_reference(x, weight, EPS, unit_offset=unit_offset)
    actual = rms_norm_triton(x, weight, EPS, unit_offset=unit_offset)
    # Llama's weight multiply follows type promotion; Gemma casts back to x's dtype.
    assert expected.dtype == (torch.bfloat16 if unit_offset else torch.float32)
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, **_tolerance(expected.dtype))


def test_empty_rows(device: str) -> None:
    _require_triton(device)
    x, weight = _inputs((0, 64), torch.float16, device)
    assert rms_norm(x, weight, EPS, backend="triton").shape == (0, 64)


def test_rejects_bad_weight_shape() -> None:
    x, weight = _inputs((2, 64), torch.float32, "cpu")
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, weight[:32], EPS)


def test_auto_uses_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def triton_called(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("backend='auto' ran the Triton kernel on CPU tensors")

    monkeypatch.setattr(rms_norm_module, "rms_norm_triton", triton_called)
    x, weight = _inputs((3, 72), torch.bfloat16, "cpu")
    assert resolve_backend("auto", x, weight) == "torch"
    assert torch.equal(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))


def test_forced_triton_on_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, weight = _inputs((3, 72), torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        rms_norm(x, weight, EPS, backend="triton")


def test_backend_rejects_mixed_devices_and_unknown_names() -> None:
    cpu = torch.zeros(4)
    with pytest.raises(ValueError, match="one device"):
        resolve_backend("auto", cpu, torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", cpu)  # type: ignore[arg-type]
    assert resolve_backend("torch", cpu) == "torch"


@pytest.mark.gpu
def test_auto_uses_triton_on_cuda() -> None:
    x = torch.zeros(4, device="cuda")
    assert resolve_backend("auto", x) == "triton"
