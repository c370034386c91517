"""A gated MLP's fused gate_up projection with silu(gate) * up taken by the decode GEMV's slot
sum (kernels.quant_matmul.quant_matmul_silu_mul, GemvShare(silu_mul=True) for LoRA, the
engine's gate_up_activation): bit for bit the GEMV followed by kernels.silu_mul, in every
float dtype, with and without LoRA's extra slot (issue 31: one kernel boundary fewer per
decode layer). Also a decode GEMV whose splits take a chunk count that is not a power of
two (gemv_tiling's `iters`, which benchmarks sweep)."""

from __future__ import annotations

import os

import pytest
import torch

from helpers.quant_weights import make_weight
from kernels.activation import silu_mul_reference, silu_mul_triton
from kernels.quant_matmul import (
    quant_matmul_reference,
    quant_matmul_silu_mul,
    quant_matmul_triton,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _require_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (unset on GPU machines)")


def _x(M: int, k: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    # Scaled so that gate values reach SiLU's curved part and the halves' roundings matter.
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(M, k, generator=gen) * 0.5).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 3])  # 3: the dot path, the two ops
@pytest.mark.parametrize("bias", [False, True])
def test_fused_equals_the_gemv_then_silu_mul(
    dtype: torch.dtype, M: int, bias: bool, device: str
) -> None:
    _require_triton(device)
    qw = make_weight(320, 2 * 136, [4, 3, 8], device=device, seed=11, bias=bias)
    x = _x(M, 320, dtype, device, seed=M)
    gate, up = quant_matmul_triton(x, qw).chunk(2, dim=-1)
    want = silu_mul_triton(gate, up)
    for _ in range(2):  # the second call finds the workspace as the first left it
        got = quant_matmul_silu_mul(x, qw, backend="triton")
        assert got.shape == (M, 136) and got.dtype == dtype
        assert torch.equal(got, want)
    # Leading dimensions are kept, as by quant_matmul.
    assert torch.equal(quant_matmul_silu_mul(x[None], qw, backend="triton"), want[None])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_roundings_between_the_ops_are_kept(dtype: torch.dtype) -> None:
    """Not vacuous: the float32 gate and up sums rounded only at the end (no rounding of the
    GEMV's output before SiLU) give other bits, which the test above would catch."""
    _require_triton("cpu")
    qw = make_weight(320, 2 * 136, [4], device="cpu", seed=11, bias=False)
    x = _x(1, 320, dtype, "cpu", seed=5)
    exact = quant_matmul_triton(x, qw, out=torch.empty(1, 272))  # float32 sums, unrounded
    gate, up = exact.chunk(2, dim=-1)
    once = (gate * torch.sigmoid(gate) * up).to(dtype)
    assert not torch.equal(quant_matmul_silu_mul(x, qw, backend="triton"), once)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_backend_is_the_two_reference_ops(dtype: torch.dtype) -> None:
    qw = make_weight(64, 2 * 48, [4], seed=3)
    x = _x(2, 64, dtype, "cpu")
    gate, up = quant_matmul_reference(x, qw).chunk(2, dim=-1)
    got = quant_matmul_silu_mul(x, qw, backend="torch")
    assert torch.equal(got, silu_mul_reference(gate, up))


def test_an_odd_output_is_refused() -> None:
    qw = make_weight(64, 97, [4], seed=3)
    with pytest.raises(ValueError, match="even"):
        quant_matmul_silu_mul(torch.randn(1, 64), qw, backend="torch")


@pytest.mark.parametrize("gemv_first", [True, False], ids=["gemv_first", "expand_first"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2])
def test_lora_expand_into_a_fused_gate_up(
    m: int, dtype: torch.dtype, gemv_first: bool, device: str
) -> None:
    """LoRA on gate_up: the expand's slot is summed with the GEMV's, then silu(gate) * up
    is taken, by one slot sum after the join: the bits of the plain share's y followed by
    silu_mul. The adapters' b covers every column of [gate | up]."""
    _require_triton(device)
    from kernels.lora_matmul import lora_expand_into_gemv, lora_shrink
    from kernels.quant_matmul.gemv_share import (
        finish_gemv_shared,
        gemv_share,
        launch_gemv_shared,
    )

    k, n, rank = 320, 2 * 128, 8
    qw = make_weight(k, n, [4, 3], device=device, seed=3)
    gen = torch.Generator().manual_seed(m)
    x = _x(m, k, dtype, device, seed=m)
    a = (torch.randn(2, rank, k, generator=gen) * 0.1).to(dtype).to(device)
    b = (torch.randn(2, n, rank, generator=gen) * 0.1).to(dtype).to(device)
    slot_map = torch.tensor([0, 1], dtype=torch.int32, device=device)
    starts = torch.arange(m + 1, dtype=torch.int32, device=device)
    scales = torch.tensor([[1.0, 0.0], [0.5, -0.75]][:m], device=device)

    def run(silu_mul: bool) -> torch.Tensor:
        share = gemv_share(x, qw, silu_mul=silu_mul)
        assert share is not None and share.silu_mul == silu_mul and share.n == n
        share.sums.fill_(float("nan"))
        partials = lora_shrink(x, a, slot_map, starts, scales)
        if gemv_first:
            launch_gemv_shared(x, qw, share)
        lora_expand_into_gemv(share, partials, b, slot_map, starts, scales)
        if not gemv_first:
            launch_gemv_shared(x, qw, share)
        finish_gemv_shared(share)
        return share.y

    plain = run(False)
    want = silu_mul_triton(*plain.chunk(2, dim=-1))
    got = run(True)
    assert got.shape == (m, n // 2)
    assert torch.equal(got, want)
    # The delta is in there: without the LoRA the product differs.
    base_gate, base_up = quant_matmul_triton(x, qw).chunk(2, dim=-1)
    assert not torch.equal(got, silu_mul_triton(base_gate, base_up))


def test_a_share_of_an_odd_output_declines_silu_mul() -> None:
    from kernels.quant_matmul.gemv_share import gemv_share

    qw = make_weight(64, 97, [4])
    assert gemv_share(torch.randn(1, 64), qw, silu_mul=True) is None
    assert gemv_share(torch.randn(1, 64), qw) is not None


@pytest.mark.parametrize("iters", [3, 5])
def test_gemv_with_a_chunk_count_that_is_not_a_power_of_two(iters: int, device: str) -> None:
    _require_triton(device)
    from kernels.quant_matmul.gemv import gemv_tiling, launch_gemv

    qw = make_weight(640, 200, [4, 3], device=device, seed=9)
    x = _x(1, 640, torch.float32, device)
    tiling = gemv_tiling(x, qw, iters=iters)
    assert tiling.iters == iters and tiling.arrivals >= 2
    y = torch.empty(1, 200, device=device)
    launch_gemv(x, qw, y, tiling)
    want = quant_matmul_reference(x, qw)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lora", [False, True])
def test_gated_mlp_fused_equals_unfused_on_cuda(
    dtype: torch.dtype, lora: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's route (GatedMLP with a quantized gate_up_proj, fuse_kernels on and off;
    with a LoRA wrapper and a decode LoRA batch, its expand on a side stream in the graph):
    the same bits, eager and in a CUDA graph, and the fused module never calls
    kernels.silu_mul."""
    import kernels
    from engine.lora.batch import LoraBatch, LoraSegments
    from engine.lora.layers import LoraLinear
    from engine.modules import GatedMLP
    from engine.quantized_linear import QuantizedLinear

    hidden, inter = 4096, 1024
    mlp = GatedMLP(hidden, inter, "silu", fuse_gate_up=True)
    qw = make_weight(hidden, 2 * inter, [4], group_size=128, device="cuda", seed=4, bias=False)
    mlp.gate_up_proj = QuantizedLinear(qw, 2 * inter, "gptq")
    down = make_weight(inter, hidden, [4], group_size=128, device="cuda", seed=5, bias=False)
    mlp.down_proj = QuantizedLinear(down, hidden, "gptq")
    batch = None
    if lora:
        wrapped = LoraLinear(mlp.gate_up_proj, head=False)
        wrapped.lora_a = (torch.randn(2, 16, hidden, device="cuda") / hidden**0.5).to(dtype)
        wrapped.lora_b = (torch.randn(2, 2 * inter, 16, device="cuda") * 0.05).to(dtype)
        wrapped.slot_map = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
        scales = torch.tensor([[0.5, 1.0]])
        seg = LoraSegments(
            starts=torch.arange(2, dtype=torch.int32, device="cuda"),
            scales=scales.cuda(),
            max_len=1,
            host_starts=[0, 1],
            host_scales=scales,
        )
        mlp.gate_up_proj = wrapped
        batch = LoraBatch(body=seg, head=seg)
    x = _x(1, hidden, dtype, "cuda")
    mlp.fuse_kernels = False
    plain = mlp(x, batch)
    calls = []
    monkeypatch.setattr(kernels, "silu_mul", lambda *a, **k: calls.append(1))
    mlp.fuse_kernels = True
    fused = mlp(x, batch)
    assert torch.equal(fused, plain)
    out = torch.empty_like(fused)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(mlp(x, batch))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)
    assert not calls
