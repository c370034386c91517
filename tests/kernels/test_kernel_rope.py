"""kernels.rope: the Triton kernel against the torch reference, the reference against a
float64 complex-multiplication formulation, argument checks, and the dispatcher."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from kernels import apply_rope
from kernels.backend import resolve_backend
from kernels.rope import apply_rope_reference, apply_rope_triton

# `kernels.apply_rope` is the op; the module is needed for monkeypatching.
rope_module = importlib.import_module("kernels.rope")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MAX_POS = 300


def _require_triton(device: str) -> None:
    # One process is either interpreted or compiled (triton.jit decides at import): on a GPU
    # machine the interpreter is off, so the Triton path cannot take CPU tensors there.
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (unset on GPU machines)")


# (T, Hq, Hk, D, R)
CASES = [
    (1, 1, 1, 8, 8),  # one decode token
    (7, 4, 2, 64, 64),  # grouped-query attention
    (5, 3, 3, 72, 72),  # R/2 = 36, not a power of two
    (6, 4, 1, 64, 32),  # partial rotary, half the head (GPT-NeoX style)
    (3, 2, 1, 80, 32),  # partial rotary 0.4 (Phi-2)
    (4, 40, 8, 128, 128),  # several head blocks per token, a partial last block
]


def _tables(rotary_dims: int, *, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    # Built like engine.rope.rope_tables: float32 angles, attention scaling folded in.
    exponents = torch.arange(0, rotary_dims, 2, dtype=torch.int64).float() / rotary_dims
    inv_freq = 1.0 / (10000.0**exponents)
    angles = torch.arange(MAX_POS, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos() * scaling, angles.sin() * scaling


def _inputs(
    case: tuple[int, int, int, int, int],
    dtype: torch.dtype,
    device: str,
    *,
    positions_dtype: torch.dtype = torch.int64,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, ...]:
    T, n_q_heads, n_k_heads, D, R = case
    generator = torch.Generator().manual_seed(T * 1000 + D + R)
    q = 2 * torch.randn(T, n_q_heads, D, generator=generator)
    k = 2 * torch.randn(T, n_k_heads, D, generator=generator)
    # Unsorted, possibly repeated: tokens of several sequences in one batch.
    positions = torch.randint(0, MAX_POS, (T,), generator=generator, dtype=positions_dtype)
    cos, sin = _tables(R, scaling=scaling)
    return (
        q.to(device, dtype),
        k.to(device, dtype),
        positions.to(device),
        cos.to(device),
        sin.to(device),
    )


def _tolerance(dtype: torch.dtype, *tensors: torch.Tensor) -> dict[str, float]:
    # Cancellation between x1*cos and x2*sin: errors scale with the inputs, not the output.
    magnitude = max(float(t.abs().max()) for t in tensors)
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-6 * magnitude}
    eps = torch.finfo(dtype).eps
    return {"rtol": 2 * eps, "atol": 2 * eps * magnitude}


def _complex_rope(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    # Pairs (i, i + R/2) as complex numbers, rotated by cos + i*sin, in float64.
    half = cos.shape[-1]
    x64 = x.double()
    z = torch.complex(x64[..., :half], x64[..., half : 2 * half])  # [T, H, R/2]
    rotation = torch.complex(cos.double(), sin.double())[positions.long()][:, None, :]
    rotated = z * rotation
    return torch.cat([rotated.real, rotated.imag, x64[..., 2 * half :]], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-Hq{}-Hk{}-D{}-R{}".format(*c))
def test_triton_matches_reference(
    device: str, case: tuple[int, int, int, int, int], dtype: torch.dtype
) -> None:
    _require_triton(device)
    q, k, positions, cos, sin = _inputs(case, dtype, device)
    q_before, k_before = q.clone(), k.clone()
    q_ref, k_ref = apply_rope(q, k, positions, cos, sin, backend="torch")
    q_rot, k_rot = apply_rope(q, k, positions, cos, sin, backend="triton")
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "inputs were modified"
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    assert q_rot.dtype == k_rot.dtype == dtype
    torch.testing.assert_close(q_rot, q_ref, **_tolerance(dtype, q, k))
    torch.testing.assert_close(k_rot, k_ref, **_tolerance(dtype, q, k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES[1:5], ids=lambda c: "T{}-Hq{}-Hk{}-D{}-R{}".format(*c))
def test_reference_matches_complex_rotation(
    device: str, case: tuple[int, int, int, int, int], dtype: torch.dtype
) -> None:
    # A yarn-like scaling: the tables need not be unit rotations.
    q, k, positions, cos, sin = _inputs(case, dtype, device, scaling=1.1)
    for x, x_rot in zip((q, k), apply_rope_reference(q, k, positions, cos, sin), strict=True):
        expected = _complex_rope(x, positions, cos, sin)
        # The reference rounds the tables, each product and the sum to dtype.
        eps = torch.finfo(dtype).eps
        magnitude = float(x.abs().max())
        torch.testing.assert_close(x_rot.double(), expected, rtol=2 * eps, atol=3 * eps * magnitude)
        rotary_dims = 2 * cos.shape[-1]
        assert torch.equal(x_rot[..., rotary_dims:], x[..., rotary_dims:])


def test_reference_matches_transformers_formula() -> None:
    # transformers' apply_rotary_pos_emb on cos/sin already cast to the activation dtype.
    q, k, positions, cos, sin = _inputs(CASES[1], torch.bfloat16, "cpu")
    cos_full = torch.cat([cos, cos], -1)[positions].to(torch.bfloat16)[:, None]
    sin_full = torch.cat([sin, sin], -1)[positions].to(torch.bfloat16)[:, None]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    q_rot, k_rot = apply_rope_reference(q, k, positions, cos, sin)
    assert torch.equal(q_rot, q * cos_full + rotate_half(q) * sin_full)
    assert torch.equal(k_rot, k * cos_full + rotate_half(k) * sin_full)


def test_position_zero_is_identity(device: str) -> None:
    _require_triton(device)
    q, k, positions, cos, sin = _inputs(CASES[3], torch.bfloat16, device)
    zeros = torch.zeros_like(positions)
    for backend in ("torch", "triton"):
        q_rot, k_rot = apply_rope(q, k, zeros, cos, sin, backend=backend)
        assert torch.equal(q_rot, q) and torch.equal(k_rot, k), backend


def test_strided_views_of_fused_qkv(device: str) -> None:
    _require_triton(device)
    T, n_q_heads, n_k_heads, D = 5, 4, 2, 64
    generator = torch.Generator().manual_seed(7)
    width = (n_q_heads + 2 * n_k_heads) * D
    qkv = torch.randn(T, width, generator=generator).to(device, torch.float16)
    q = qkv[:, : n_q_heads * D].view(T, n_q_heads, D)
    k = qkv[:, n_q_heads * D : (n_q_heads + n_k_heads) * D].view(T, n_k_heads, D)
    assert not q.is_contiguous() and not k.is_contiguous()
    positions = torch.arange(10, 10 + T, dtype=torch.int32, device=device)
    cos, sin = (t.to(device) for t in _tables(48))  # partial rotary too
    q_ref, k_ref = apply_rope_reference(q.contiguous(), k.contiguous(), positions, cos, sin)
    q_rot, k_rot = apply_rope_triton(q, k, positions, cos, sin)
    torch.testing.assert_close(q_rot, q_ref, **_tolerance(torch.float16, q, k))
    torch.testing.assert_close(k_rot, k_ref, **_tolerance(torch.float16, q, k))


def test_strided_head_dim_and_int32_positions(device: str) -> None:
    _require_triton(device)
    q, k, positions, cos, sin = _inputs(
        CASES[1], torch.float32, device, positions_dtype=torch.int32
    )
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # last dim not dense
    assert q_strided.stride(-1) != 1
    q_ref, k_ref = apply_rope_reference(q, k, positions, cos, sin)
    q_rot, k_rot = apply_rope_triton(q_strided, k, positions, cos, sin)
    torch.testing.assert_close(q_rot, q_ref, **_tolerance(torch.float32, q, k))
    torch.testing.assert_close(k_rot, k_ref, **_tolerance(torch.float32, q, k))


def test_empty_batch(device: str) -> None:
    _require_triton(device)
    q, k, positions, cos, sin = _inputs((0, 4, 2, 64, 64), torch.float16, device)
    for backend in ("torch", "triton"):
        q_rot, k_rot = apply_rope(q, k, positions, cos, sin, backend=backend)
        assert q_rot.shape == (0, 4, 64) and k_rot.shape == (0, 2, 64)


def _bad(name: str) -> tuple[torch.Tensor, ...]:
    q, k, positions, cos, sin = _inputs((3, 4, 2, 64, 32), torch.float16, "cpu")
    if name == "head dims":
        k = k[..., :32]
    elif name == "rotary dims":
        cos, sin = _tables(80)
    elif name == "positions length":
        positions = positions[:2]
    elif name == "positions dtype":
        positions = positions.float()
    elif name == "table shapes":
        sin = sin[:, :8]
    elif name == "dtypes":
        k = k.float()
    elif name == "token counts":
        k = k[:2]
    return q, k, positions, cos, sin


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("head dims", "head dims differ"),
        ("rotary dims", "exceed the head dim"),
        ("positions length", "positions has 2 entries"),
        ("positions dtype", "int32/int64"),
        ("table shapes", "cos and sin must both be"),
        ("dtypes", "must share one of"),
        ("token counts", "same T"),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rejects_bad_arguments(device: str, name: str, message: str, backend: str) -> None:
    if backend == "triton":
        _require_triton(device)
    args = [t.to(device) for t in _bad(name)]
    with pytest.raises(ValueError, match=message):
        apply_rope(*args, backend=backend)


def test_reference_rejects_positions_outside_tables() -> None:
    q, k, positions, cos, sin = _inputs(CASES[1], torch.float32, "cpu")
    positions[-1] = MAX_POS
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 300\)"):
        apply_rope_reference(q, k, positions, cos, sin)


def test_auto_uses_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def triton_called(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("backend='auto' ran the Triton kernel on CPU tensors")

    monkeypatch.setattr(rope_module, "apply_rope_triton", triton_called)
    q, k, positions, cos, sin = _inputs(CASES[1], torch.bfloat16, "cpu")
    assert resolve_backend("auto", q, k, positions, cos, sin) == "torch"
    q_rot, k_rot = apply_rope(q, k, positions, cos, sin)
    q_ref, k_ref = apply_rope_reference(q, k, positions, cos, sin)
    assert torch.equal(q_rot, q_ref) and torch.equal(k_rot, k_ref)
