"""kernels/quant_matmul's Triton kernels against its torch references.

Every Triton path (the GEMV, the tensor-core split-K kernel and dequantize + matmul) is
checked on fresh random weights: each segment width, mixed widths in one matrix, with and
without act-order permutation and bias, regular, short and irregular groups, odd shapes,
M = 1, 3 and 17, x in float16, bfloat16 and float32. On CPU the kernels run in the Triton
interpreter, so shapes stay tiny; with CUDA the same tests run on the GPU, plus Llama-8B
shapes.

Tolerance: ||out - ref|| / ||ref|| below 1e-3 for float16 outputs (float32 math rounded once)
and 5e-3 for bfloat16; float32 outputs differ only by summation order.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os

import pytest
import torch

from helpers.quant_weights import make_weight
from kernels.quant_matmul import (
    QuantizedWeight,
    dequantize_reference,
    dequantize_triton,
    quant_matmul,
    quant_matmul_reference,
    quant_matmul_triton,
)
from kernels.quant_matmul.layout import compact_zero_points, per_group_zeros, stored_bytes

# The modules, for monkeypatching their tuning constants (the functions are imported above).
# (`kernels.quant_matmul` is the op itself in the package `kernels`: import_module finds the
# subpackage's modules.)
gemv = importlib.import_module("kernels.quant_matmul.gemv")
qdot = importlib.import_module("kernels.quant_matmul.dot")
dequant = importlib.import_module("kernels.quant_matmul.dequantize")
paths = importlib.import_module("kernels.quant_matmul.paths")
dispatch = importlib.import_module("kernels.quant_matmul.dispatch")
split_k = importlib.import_module("kernels.quant_matmul.split_k")

WIDTHS = [2, 3, 4, 5, 6, 8]
TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 5e-3, torch.float32: 1e-5}


def _require_triton(device: str) -> None:
    # One process is either interpreted or compiled (triton.jit decides at import): on a GPU
    # machine the interpreter is off, so the Triton path cannot take CPU tensors there.
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (unset on GPU machines)")


def _x(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device, dtype)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}"


def _check(
    qw: QuantizedWeight, M: int, dtype: torch.dtype, device: str, path: str, seed: int = 1
) -> None:
    x = _x((M, qw.in_features), dtype, device, seed)
    out = quant_matmul_triton(x, qw, path=path)
    _assert_close(out, quant_matmul_reference(x, qw), dtype)


# --- zero points -----------------------------------------------------------------------------


def test_compact_zero_points_keep_every_value() -> None:
    four_bit = torch.tensor([[1.0, 16.0], [8.0, 0.0]], dtype=torch.float16)
    assert compact_zero_points(four_bit).dtype == torch.uint8
    eight_bit = torch.tensor([[1.0, 256.0]], dtype=torch.float16)  # GPTQ v1: 255 + 1
    assert compact_zero_points(eight_bit).dtype == torch.int16
    fractional = torch.tensor([[7.5, 2.0]], dtype=torch.float16)
    assert compact_zero_points(fractional).dtype == torch.float16
    for zeros in (four_bit, eight_bit, fractional):
        assert torch.equal(compact_zero_points(zeros).half(), zeros)


@pytest.mark.parametrize("widths,top", [([4, 3], 16), ([8], 256)], ids=["uint8", "int16"])
@pytest.mark.parametrize("path,M", [("gemv", 1), ("dot", 3), ("dot", 17), ("dequant", 17)])
def test_integer_zero_points_in_compact_dtypes(
    device: str, widths: list[int], top: int, path: str, M: int
) -> None:
    # GPTQ and EXL2 zero points are integers, stored as uint8 (int16 when one is 256):
    # every path reads them as the fp16 ones.
    _require_triton(device)
    qw = make_weight(256, 96, widths, group_size=32, device=device)
    generator = torch.Generator().manual_seed(4)
    zeros = torch.randint(0, top + 1, tuple(qw.zeros.shape), generator=generator)
    zeros[0, 0] = top
    qw.zeros = zeros.half().to(device)
    x = _x((M, qw.in_features), torch.float16, device)
    expected = quant_matmul_triton(x, qw, path=path)
    qw.zeros = compact_zero_points(qw.zeros)
    assert qw.zeros.dtype == (torch.uint8 if top < 256 else torch.int16)
    qw.validate()
    got = quant_matmul_triton(x, qw, path=path)
    # The interpreter sums in a fixed order: the very same values, except where uint8 zero
    # points let the mid-M path fold them into its fp16 operand (DotConfig.fold), which
    # rounds W to fp16 as dequantization does.
    folded = path == "dot" and qw.zeros.dtype == torch.uint8
    if device == "cpu" and not folded:
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    _assert_close(got, quant_matmul_reference(x, qw), torch.float16)
    _assert_close(expected, quant_matmul_reference(x, qw), torch.float16)


@pytest.mark.parametrize("group_size", [32, 128], ids=["rows_groups", "chunk_groups"])
@pytest.mark.parametrize("path,M", [("gemv", 1), ("gemv", 4), ("dot", 3), ("dot", 17)])
def test_one_zero_point_per_group(device: str, group_size: int, path: str, M: int) -> None:
    # EXL2 (2^(bits-1)) and symmetric GPTQ zero points do not vary along n: they are kept as
    # one column expanded over n, and every path reads zeros[group] for them. Small groups
    # take the kernels' per-row zero path, groups as long as a chunk the per-chunk one.
    _require_triton(device)
    qw = make_weight(512, 96, [4, 6, 3], group_size=group_size, perm=True, device=device)
    column = torch.randint(0, 64, (qw.num_groups, 1), generator=torch.Generator().manual_seed(5))
    # Materialized as uint8, so that both runs take the same operand (DotConfig.fold).
    materialized = column.expand(qw.num_groups, qw.out_features).to(torch.uint8).contiguous()
    qw.zeros = materialized.to(device)
    x = _x((M, qw.in_features), torch.float16, device)
    expected = quant_matmul_triton(x, qw, path=path)
    dense = dequantize_triton(qw, dtype=torch.float32)
    qw.zeros = compact_zero_points(materialized.half()).to(device)
    assert per_group_zeros(qw.zeros) and qw.zeros.dtype == torch.uint8
    assert stored_bytes(qw.zeros) == qw.num_groups
    qw.validate()
    moved = qw.to(device)
    assert per_group_zeros(moved.zeros)
    got = quant_matmul_triton(x, qw, path=path)
    if device == "cpu":  # the interpreter sums in a fixed order: the very same values
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    _assert_close(got, quant_matmul_reference(x, qw), torch.float16)
    # bf16 x takes the unfolded kernels, which read zeros[group] too.
    x_bf16 = _x((M, qw.in_features), torch.bfloat16, device)
    _assert_close(
        quant_matmul_triton(x_bf16, qw, path=path), quant_matmul_reference(x_bf16, qw),
        torch.bfloat16,
    )  # fmt: skip
    torch.testing.assert_close(dequantize_triton(qw, dtype=torch.float32), dense, rtol=0, atol=0)
    torch.testing.assert_close(dense, dequantize_reference(qw), rtol=0, atol=0)


def test_zero_points_that_vary_along_n_stay_whole() -> None:
    zeros = torch.full((3, 5), 8.0)
    zeros[1, 4] = 7.0
    compact = compact_zero_points(zeros)
    assert compact.is_contiguous() and not per_group_zeros(compact)
    assert stored_bytes(compact) == 15 and torch.equal(compact.half(), zeros.half())


# --- dequantization --------------------------------------------------------------------------


@pytest.mark.parametrize("widths", [[w] for w in WIDTHS] + [WIDTHS], ids=str)
@pytest.mark.parametrize("perm", [True, False], ids=["perm", "no_perm"])
def test_dequantize_matches_reference(device: str, widths: list[int], perm: bool) -> None:
    _require_triton(device)
    qw = make_weight(200, 96, widths, perm=perm, device=device)
    ref = dequantize_reference(qw)
    # code * scale - zero is exact-then-rounded-once in float32 on both sides.
    torch.testing.assert_close(dequantize_triton(qw, dtype=torch.float32), ref, rtol=0, atol=0)
    if perm:
        permuted = dequantize_triton(qw, dtype=torch.float32, permuted=True)
        torch.testing.assert_close(permuted, ref[qw.perm.long()], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_rounds_like_torch(device: str, dtype: torch.dtype) -> None:
    _require_triton(device)
    qw = make_weight(160, 64, [8, 4, 3], device=device)
    expected = dequantize_reference(qw).to(dtype)
    torch.testing.assert_close(dequantize_triton(qw, dtype=dtype), expected, rtol=0, atol=0)


@pytest.mark.parametrize("perm", [True, False], ids=["perm", "no_perm"])
@pytest.mark.parametrize("per_group", [True, False], ids=["group_zeros", "full_zeros"])
def test_dequantize_a_column_range(device: str, perm: bool, per_group: bool) -> None:
    """Columns [c0, c1) alone equal those columns of the whole W (the chunks of the
    dequantize + cuBLAS path), zero points one per group or per column."""
    _require_triton(device)
    qw = make_weight(200, 384, [8, 4, 3], perm=perm, device=device)
    if per_group:
        qw = dataclasses.replace(qw, zeros=compact_zero_points(qw.zeros[:, :1].expand_as(qw.zeros)))
        assert per_group_zeros(qw.zeros)
    ref = dequantize_reference(qw)
    for c0, c1 in ((0, 128), (128, 384), (256, 300), (0, 384)):
        got = dequantize_triton(qw, dtype=torch.float32, cols=(c0, c1))
        torch.testing.assert_close(got, ref[:, c0:c1], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"cols \(300, 400\) are not a range of the 384"):
        dequantize_triton(qw, cols=(300, 400))


def test_dequant_chunk_columns_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    # 70B's fused gate/up in fp16: 0.94 GB, so chunks of 16384 columns (256 MiB); the 8B
    # model's (235 MB) stays whole.
    assert dequant.dequant_chunk_columns(8192, 57344, 2) == 16384
    assert dequant.dequant_chunk_columns(4096, 28672, 2) == 28672
    # At least one dequantization tile, whatever the limit.
    monkeypatch.setattr(dequant, "DEQUANT_SCRATCH_MAX_BYTES", 1)
    assert dequant.dequant_chunk_columns(8192, 57344, 2) == 128


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_dequant_path_in_column_chunks(
    device: str, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A linear past DEQUANT_SCRATCH_MAX_BYTES goes through dense chunks of its columns, each
    product written into its columns of the output: the whole-W product's result."""
    _require_triton(device)
    qw = make_weight(256, 640, [4, 3], bias=bias, device=device)
    x = _x((300, 256), torch.float32, device)
    whole = quant_matmul_triton(x, qw, path="dequant")
    # Two dequantization tiles per chunk: 640 columns in chunks of 256, 256 and 128.
    monkeypatch.setattr(dequant, "DEQUANT_SCRATCH_MAX_BYTES", 256 * 4 * 256)
    assert dequant.dequant_chunk_columns(256, 640, 4) == 256
    chunked = quant_matmul_triton(x, qw, path="dequant")
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-5)
    _assert_close(chunked, quant_matmul_reference(x, qw), torch.float32)


# --- the matmul paths ------------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("path,M", [("gemv", 1), ("dot", 17)])
def test_each_width(device: str, width: int, path: str, M: int) -> None:
    _require_triton(device)
    qw = make_weight(200, 96, [width], seed=width, device=device)
    _check(qw, M, torch.float16, device, path)


# Mixed widths (all six in one matrix), k and n off every block size, a short last group.
MIXED_CASES = [
    ("gemv", 1, torch.float16),
    ("gemv", 3, torch.bfloat16),
    ("gemv", 1, torch.float32),
    ("dot", 3, torch.float16),
    ("dot", 17, torch.bfloat16),
    ("dot", 17, torch.float32),
    ("dequant", 17, torch.float16),
    ("dequant", 3, torch.bfloat16),
]


@pytest.mark.parametrize("path,M,dtype", MIXED_CASES, ids=str)
def test_mixed_segments(device: str, path: str, M: int, dtype: torch.dtype) -> None:
    _require_triton(device)
    qw = make_weight(200, 96, WIDTHS, device=device)
    _check(qw, M, dtype, device, path)


@pytest.mark.parametrize("perm", [True, False], ids=["perm", "no_perm"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("path,M", [("gemv", 3), ("dot", 17), ("dequant", 17)])
def test_perm_and_bias(device: str, perm: bool, bias: bool, path: str, M: int) -> None:
    _require_triton(device)
    qw = make_weight(136, 80, [5, 4], perm=perm, bias=bias, device=device)
    _check(qw, M, torch.float16, device, path)


@pytest.mark.parametrize(
    "group_size,group_sizes,grouped",
    [
        (32, None, True),
        (128, None, True),  # 256 = 2 groups: the tensor-core path takes 64-row chunks
        (0, [48, 48, 64, 80, 16], False),  # sizes off 32: chunks straddle groups
    ],
    ids=["g32", "g128", "irregular"],
)
@pytest.mark.parametrize("path,M", [("gemv", 1), ("dot", 17)])
def test_group_layouts(
    device: str,
    group_size: int,
    group_sizes: list[int] | None,
    grouped: bool,
    path: str,
    M: int,
) -> None:
    _require_triton(device)
    qw = make_weight(256, 64, [4, 3], group_size=group_size, group_sizes=group_sizes, device=device)
    # Chunks of one group take the per-chunk scale path, the others the per-row one.
    assert split_k.chunks_in_groups(qw, 32) is grouped
    _check(qw, M, torch.float16, device, path)


@pytest.mark.parametrize(
    "path,M,prefetch,stages",
    [
        ("gemv", 2, False, 1),
        ("gemv", 1, True, 1),
        ("gemv", 2, True, 1),
        ("gemv", 1, False, 3),
        ("gemv", 2, True, 3),
        ("dot", 17, False, 1),
    ],
)
def test_several_column_tiles_and_chunks_per_program(
    device: str, path: str, M: int, prefetch: bool, stages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One program per SM wanted: each split-K slice walks several chunks (with the next
    # chunk's words prefetched or not, the loop software-pipelined or not: the interpreter
    # runs the plain loop either way, a GPU stages the loads through shared memory; 6 bits
    # are two planes, and the 8 chunks of a slice end where the segment does). Two columns
    # per thread: n = 200 spans two column tiles (128 + a partial one) on both paths.
    _require_triton(device)
    config = gemv.GemvConfig(
        num_warps=2, cols_per_thread=(2, 2, 2, 2), programs_per_sm=1, max_iters=8,
        prefetch=prefetch, stages=stages,
    )  # fmt: skip
    monkeypatch.setattr(gemv, "_GEMV_CONFIG", config)
    monkeypatch.setattr(
        qdot, "_DOT_CONFIGS", ((1 << 62, dataclasses.replace(qdot.DotConfig(), programs_per_sm=1)),)
    )
    monkeypatch.setattr(split_k, "sm_count", lambda device: 1)
    qw = make_weight(256, 200, [6], device=device)
    if path == "gemv":
        x = torch.zeros(M, 256, dtype=torch.float16, device=device)
        assert gemv.gemv_tiling(x, qw).iters == 8
    assert split_k.split_iters(256, 2, 32, 1, 8, torch.device(device)) == 8  # chunks per program
    _check(qw, M, torch.float16, device, path)


# Each layout of the tensor-core path: untransposed or transposed (weights as the left
# operand), whole-word or row-gathered unpacking. Mixed widths with perm and bias (two
# planes for 3, 5 and 6 bits), groups off the chunk size (the per-row scale path), and x
# in each dtype with rows that do not fill the tile.
DOT_VARIANTS = [qdot.DotConfig(transposed=t, wide=w) for t in (False, True) for w in (True, False)]
DOT_CASES = [
    ("mixed", 17, torch.float16),
    ("mixed", 3, torch.bfloat16),
    ("mixed", 40, torch.float32),
    ("irregular", 17, torch.float16),
]


@pytest.mark.parametrize(
    "config", DOT_VARIANTS, ids=lambda c: f"t{int(c.transposed)}w{int(c.wide)}"
)
@pytest.mark.parametrize("case,M,dtype", DOT_CASES, ids=str)
def test_dot_variants(
    device: str,
    config: qdot.DotConfig,
    case: str,
    M: int,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _require_triton(device)
    monkeypatch.setattr(
        qdot, "_DOT_CONFIGS", ((1 << 62, dataclasses.replace(config, max_block_m=32)),)
    )
    if case == "mixed":
        qw = make_weight(200, 96, WIDTHS, device=device)
    else:
        qw = make_weight(256, 64, [4, 3], group_size=0, group_sizes=[48, 48, 64, 80, 16],
                         device=device)  # fmt: skip
        assert not split_k.chunks_in_groups(qw, 32)
    _check(qw, M, dtype, device, "dot")


@pytest.mark.parametrize("fold", [1, 2])
@pytest.mark.parametrize("transposed", [False, True], ids=["t0", "t1"])
@pytest.mark.parametrize("per_group", [False, True], ids=["column_zeros", "group_zeros"])
def test_dot_folds_zero_points_and_scales_into_the_operand(
    device: str, fold: int, transposed: bool, per_group: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DotConfig.fold: the operand is code - zero (1), or (code - zero) * scale in fp16 (2),
    # exact for integer zero points in uint8. With 2 the tensor cores see the very fp16
    # weights that dequantize_triton writes, so the product is that matmul's up to the
    # summation order.
    _require_triton(device)
    config = qdot.DotConfig(transposed=transposed, max_block_m=32, fold=fold)
    monkeypatch.setattr(qdot, "_DOT_CONFIGS", ((1 << 62, config),))
    monkeypatch.setattr(qdot, "_UNFOLDED_DOT_CONFIGS", ())  # a fallback would raise
    qw = make_weight(512, 96, [4, 6, 3], group_size=128, device=device)
    assert split_k.chunks_in_groups(qw, split_k.chunk_rows(qw, 16, config.max_block_k))
    generator = torch.Generator().manual_seed(6)
    shape = (qw.num_groups, 1 if per_group else qw.out_features)
    zeros = torch.randint(0, 64, shape, generator=generator).expand(qw.zeros.shape)
    qw.zeros = compact_zero_points(zeros.half().contiguous()).to(device)
    assert qw.zeros.dtype == torch.uint8 and per_group_zeros(qw.zeros) == per_group
    assert qdot._fold(config, qw, torch.float16, grouped=True) == fold
    assert qdot._fold(config, qw, torch.bfloat16, grouped=True) == 0
    assert qdot._fold(config, qw, torch.float16, grouped=False) == 0
    for M in (3, 17):
        x = _x((M, qw.in_features), torch.float16, device, seed=M)
        got = quant_matmul_triton(x, qw, path="dot")
        _assert_close(got, quant_matmul_reference(x, qw), torch.float16)
        if fold == 2:
            dense = dequantize_triton(qw, dtype=torch.float16).float()
            expected = x.float() @ dense
            if qw.bias is not None:
                expected += qw.bias.float()
            torch.testing.assert_close(got.float(), expected, rtol=2e-3, atol=2e-3)
    if fold == 2:  # scales of another dtype fold the zero points only
        wide_scales = dataclasses.replace(qw, scales=qw.scales.float())
        assert qdot._fold(config, wide_scales, torch.float16, grouped=True) == 1
    fractional = qw.zeros.half() + 0.5
    qw.zeros = fractional
    assert qdot._fold(config, qw, torch.float16, grouped=True) == 0


@pytest.mark.parametrize("M", [3, 20, 40, 80])
def test_default_folded_tiles(device: str, M: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each entry of the default folded table (16-, 32- and 64-row tiles, 32 chunks per slice
    # past 64 rows) on a GPTQ-like weight (uint8 zero points, act-order), against the
    # reference; none may fall back to the unfolded table.
    _require_triton(device)
    monkeypatch.setattr(qdot, "_UNFOLDED_DOT_CONFIGS", ())
    qw = make_weight(512, 160, [4], group_size=128, device=device, seed=M)
    zeros = torch.randint(0, 16, tuple(qw.zeros.shape), generator=torch.Generator().manual_seed(M))
    qw.zeros = compact_zero_points(zeros.half()).to(device)
    assert qdot._dot_config(M).fold == 2
    _check(qw, M, torch.float16, device, "dot", seed=M)


def test_gemv_every_row_count(device: str) -> None:
    # One accumulator per row of x is unrolled in the kernel: check all eight.
    _require_triton(device)
    qw = make_weight(64, 32, [4], device=device)
    for M in range(1, paths.GEMV_LIMIT_M + 1):
        _check(qw, M, torch.float16, device, "gemv", seed=M)


def test_workspace_slots_need_no_zeroing(device: str) -> None:
    # The GEMV and the mid-M path store partials in slots of a shared workspace that nothing
    # zeroes: calls of different shapes, paths and row counts in turn each equal the
    # reference (M = 3 takes the transposed kernel, M = 20 the 64-row one; both grow it),
    # even with NaN left in every slot, and each leaves the tile counters at 0.
    _require_triton(device)
    weights = [
        make_weight(256, 200, [4, 3], device=device, seed=1),
        make_weight(96, 512, [8], device=device, seed=2, bias=False),
    ]
    for path, M in (("gemv", 1), ("gemv", 2), ("dot", 3), ("dot", 20), ("gemv", 1), ("dot", 5)):
        for i, qw in enumerate(weights):
            sums, _ = split_k.split_k_workspace(qw.device, 1, 1)
            sums.fill_(float("nan"))
            _check(qw, M, torch.float16, device, path, seed=10 * M + i)
    _, counters = split_k._WORKSPACES[weights[0].device]  # "cuda" is keyed as cuda:0
    assert not counters.any()


def test_workspace_growth_keeps_the_old_one_alive(device: str) -> None:
    # A CUDA graph captured before the workspace grew still stores into the old buffer: it
    # must stay allocated (not handed to another tensor).
    dev = torch.device(device)
    before = split_k.split_k_workspace(dev, 1, 1)
    need = before[0].numel() + 1
    after = split_k.split_k_workspace(dev, need, 1)
    assert after[0].numel() >= max(need, 2 * before[0].numel())  # grows at least twofold
    assert any(old[0] is before[0] for old in split_k._RETIRED_WORKSPACES)
    assert not before[1].any() and not after[1].any()  # counters start at 0


def test_leading_dims_and_empty_rows(device: str) -> None:
    _require_triton(device)
    qw = make_weight(72, 40, [4], device=device)
    x = _x((2, 3, 72), torch.float16, device)
    out = quant_matmul_triton(x, qw)
    assert out.shape == (2, 3, 40)
    _assert_close(out, quant_matmul_reference(x, qw), torch.float16)
    empty = quant_matmul_triton(x[:0], qw)
    assert empty.shape == (0, 3, 40) and empty.dtype == torch.float16


# --- dispatch --------------------------------------------------------------------------------


def test_path_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    assert paths.choose_path(1) == "gemv"
    assert paths.choose_path(paths.GEMV_MAX_M) == "gemv"
    assert paths.choose_path(paths.GEMV_MAX_M + 1) == "dot"
    assert paths.choose_path(paths.DEQUANT_MIN_M) == "dequant"
    assert paths.GEMV_MAX_M <= paths.GEMV_LIMIT_M
    monkeypatch.setattr(paths, "GEMV_MAX_M", 2)
    monkeypatch.setattr(paths, "DEQUANT_MIN_M", 16)
    assert [paths.choose_path(M) for M in (1, 3, 17)] == ["gemv", "dot", "dequant"]


def test_dispatcher_routes_by_rows(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The public op with backend="triton": M = 1, 3, 17 take the three paths once the
    # thresholds are lowered; each path is spied on (wrapped, not replaced).
    _require_triton(device)
    monkeypatch.setattr(paths, "GEMV_MAX_M", 2)
    monkeypatch.setattr(paths, "DEQUANT_MIN_M", 16)
    taken: list[str] = []
    for name in ("launch_gemv", "launch_dot", "dequant_matmul"):
        original = getattr(dispatch, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            taken.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(dispatch, name, spy)
    qw = make_weight(96, 48, [6, 4], device=device)
    for M in (1, 3, 17):
        x = _x((M, 96), torch.bfloat16, device, seed=M)
        _assert_close(quant_matmul(x, qw, backend="triton"), quant_matmul_reference(x, qw), x.dtype)
    assert taken == ["launch_gemv", "launch_dot", "dequant_matmul"]


@pytest.mark.parametrize("path,M", [("gemv", 1), ("gemv", 3), ("dot", 17), ("dequant", 17)])
def test_float32_out_takes_the_sums_unrounded(device: str, path: str, M: int) -> None:
    """A float16 x into a float32 `out` gives what a float32 x gives (the kernels sum in
    float32 either way): tensor parallelism's row-parallel linears write their partial
    products so, straight into the all-reduce's buffer, with no cast of x and no copy."""
    _require_triton(device)
    qw = make_weight(136, 80, [5, 4], perm=True, bias=True, device=device)
    x = _x((M, qw.in_features), torch.float16, device)
    out = torch.full((M, qw.out_features), float("nan"), device=device)
    got = quant_matmul_triton(x, qw, path=path, out=out)
    assert got is out
    want = quant_matmul_triton(x.float(), qw, path=path)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    # Rounded once to float16, it is the float16 result.
    _assert_close(out.half(), quant_matmul_triton(x, qw, path=path), torch.float16)


def test_out_on_the_reference_path_and_its_checks() -> None:
    qw = make_weight(64, 32, [4, 3])
    x = _x((2, 3, 64), torch.float16, "cpu")
    out = torch.empty(2, 3, 32)
    assert quant_matmul(x, qw, backend="torch", out=out) is out
    torch.testing.assert_close(out, quant_matmul_reference(x.float(), qw), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 3, 32\)"):
        quant_matmul(x, qw, backend="torch", out=torch.empty(6, 32))
    with pytest.raises(ValueError, match="out must be torch.float16 .* or float32"):
        quant_matmul(x, qw, backend="torch", out=torch.empty(2, 3, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        quant_matmul(x, qw, backend="torch", out=torch.empty(2, 32, 3).transpose(1, 2))


def test_auto_and_torch_backends_use_the_reference_on_cpu() -> None:
    qw = make_weight(64, 32, [4, 3])
    x = _x((3, 64), torch.float16, "cpu")
    ref = quant_matmul_reference(x, qw)
    torch.testing.assert_close(quant_matmul(x, qw), ref, rtol=0, atol=0)
    torch.testing.assert_close(quant_matmul(x, qw, backend="torch"), ref, rtol=0, atol=0)


# --- validation ------------------------------------------------------------------------------


def test_rejects_wrong_in_features() -> None:
    qw = make_weight(64, 32, [4])
    with pytest.raises(ValueError, match=r"\(65\).*k=64"):
        quant_matmul(torch.zeros(2, 65, dtype=torch.float16), qw, backend="torch")


def test_rejects_unsupported_dtype() -> None:
    qw = make_weight(64, 32, [4])
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        quant_matmul(torch.zeros(2, 64, dtype=torch.float64), qw)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        quant_matmul_triton(torch.zeros(2, 64, dtype=torch.int32), qw)
    with pytest.raises(ValueError, match="dtype must be"):
        dequantize_triton(qw, dtype=torch.int8)


def test_rejects_device_mismatch() -> None:
    qw = make_weight(64, 32, [4])
    x = torch.zeros(2, 64, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="x is on meta but the quantized weight is on cpu"):
        quant_matmul(x, qw)


def test_rejects_unknown_path() -> None:
    _require_triton("cpu")
    qw = make_weight(64, 32, [4])
    with pytest.raises(ValueError, match="path must be"):
        quant_matmul_triton(torch.zeros(1, 64, dtype=torch.float16), qw, path="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at most"):
        quant_matmul_triton(torch.zeros(9, 64, dtype=torch.float16), qw, path="gemv")


# --- real shapes on a GPU --------------------------------------------------------------------

LLAMA_8B_MLP = [(4096, 14336), (14336, 4096)]  # up/gate (k, n) and down


@functools.cache
def _gpu_weight(
    k: int, n: int, widths: tuple[int, ...], group_size: int, perm: bool
) -> QuantizedWeight:
    # Packing 58M codes takes seconds on the CPU: build each weight once per session.
    return make_weight(k, n, list(widths), group_size=group_size, perm=perm, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", LLAMA_8B_MLP, ids=["up", "down"])
@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize(
    "widths,group_size,perm",
    [((4,), 128, False), ((6, 5, 4, 3), 32, True)],
    ids=["gptq4", "exl2_mixed"],
)
def test_llama_8b_shapes_on_gpu(
    k: int, n: int, M: int, widths: tuple[int, ...], group_size: int, perm: bool
) -> None:
    qw = _gpu_weight(k, n, widths, group_size, perm)
    x = _x((M, k), torch.float16, "cuda")
    ref = quant_matmul_reference(x, qw)
    _assert_close(quant_matmul(x, qw), ref, torch.float16)
    for path in ("gemv", "dot", "dequant") if M <= paths.GEMV_LIMIT_M else ("dot", "dequant"):
        _assert_close(quant_matmul_triton(x, qw, path=path), ref, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8])
def test_cuda_graph_capture(M: int) -> None:
    # Decode runs as a CUDA graph: after one eager call (which caches the per-weight group
    # check, a device sync) the op must capture, and replays must follow new inputs.
    qw = _gpu_weight(4096, 1024, (6, 4), 32, True)
    x = _x((M, 4096), torch.bfloat16, "cuda")
    quant_matmul(x, qw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_matmul(x, qw)
    for seed in (2, 3):
        x.copy_(_x((M, 4096), torch.bfloat16, "cuda", seed=seed))
        graph.replay()
        _assert_close(out, quant_matmul_reference(x, qw), torch.bfloat16)
