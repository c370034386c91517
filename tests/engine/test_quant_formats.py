"""engine.quant (EXL2 and GPTQ on disk) and the runtime layout of kernels.quant_matmul.

For every format: pack -> unpack round trips, the runtime layout's dequantization against
the format's reference dequantizer, round-to-nearest quality, hand-built bit layouts that
do not go through the packer, and the corruptions a reader must refuse.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from engine.quant import (
    EXL2_MAX_IN_FEATURES,
    Exl2Tensors,
    GptqTensors,
    QuantFormatError,
    dequantize_exl2,
    dequantize_gptq,
    exl2_to_runtime,
    gptq_to_runtime,
    pack_exl2,
    quantize_rtn_exl2,
    quantize_rtn_gptq,
)
from engine.quant.bitpack import (
    make_segment,
    pack_along_columns,
    pack_bitstream,
    pack_plane,
    packed_rows,
    unpack_along_columns,
    unpack_bitstream,
    unpack_plane,
)
from engine.quant.exl2 import exl2_scales
from engine.quant.gptq import infer_group_size
from kernels.quant_matmul import dequantize_reference, quant_matmul_reference


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _signed(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _stream_by_hand(codes: list[list[int]], bits: int) -> torch.Tensor:
    """Pack columns of codes as one little-endian bit stream with Python integers."""
    rows, cols = len(codes), len(codes[0])
    words = -(-rows * bits // 32)
    out = [[0] * cols for _ in range(words)]
    for c in range(cols):
        stream = 0
        for i in range(rows):
            stream |= codes[i][c] << (i * bits)
        for j in range(words):
            out[j][c] = _signed((stream >> (32 * j)) & 0xFFFFFFFF)
    return torch.tensor(out, dtype=torch.int32)


# ------------------------------------------------------------------------------ bit layouts


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("rows", [1, 16, 31, 32, 33, 100])
def test_bitstream_round_trip_and_hand_layout(bits: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + rows)
    codes = torch.randint(0, 1 << bits, (rows, 3), generator=gen)
    codes[0] = (1 << bits) - 1  # top bits set: words with the sign bit on
    packed = pack_bitstream(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (packed_rows(rows, bits), 3)
    assert torch.equal(packed, _stream_by_hand(codes.tolist(), bits))
    assert torch.equal(unpack_bitstream(packed, bits, rows).long(), codes)
    if bits in (1, 2, 4, 8):  # the runtime plane layout is the same stream
        assert torch.equal(pack_plane(codes, bits), packed)
        assert torch.equal(unpack_plane(packed, bits, rows).long(), codes)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32], ids=str)
def test_plane_packing_of_any_code_dtype_and_width(bits: int, n: int, dtype: torch.dtype):
    # pack_plane builds each word from 4 bytes (the loader's repacking of a big EXL2 head
    # went 13.3 -> 1.7 s on a 2-core CPU): any code dtype, a single column, a short tail.
    gen = torch.Generator().manual_seed(bits + 10 * n)
    for rows in (1, 7, 32, 45):
        codes = torch.randint(0, 1 << bits, (rows, n), generator=gen)
        codes[-1] = (1 << bits) - 1
        packed = pack_plane(codes.to(dtype), bits)
        assert packed.dtype == torch.int32 and packed.is_contiguous()
        assert torch.equal(packed, _stream_by_hand(codes.tolist(), bits))
        # A plane of wider codes: bits [2, 2 + bits) of codes with other bits around them.
        wide = (codes << 2) | 3 | (1 << (bits + 2) if bits < 6 else 0)
        if int(wide.max()) < 256 or dtype != torch.uint8:
            assert torch.equal(pack_plane(wide.to(dtype), bits, 2), packed)


def test_exl2_3bit_layout_by_hand() -> None:
    """A 3-bit EXL2 linear built with Python bit arithmetic only, then read back."""
    k, n = 32, 8
    codes = [[(3 * i + 5 * c + 1) % 8 for c in range(n)] for i in range(k)]
    codes[10][0] = 0b101
    q_weight = _stream_by_hand(codes, 3)
    # exllamav2's qdq_3.cuh: row 10 straddles: bits 30-31 of word 0, bit 0 of word 1.
    assert (int(q_weight[0, 0]) >> 30) & 3 == 0b01 and int(q_weight[1, 0]) & 1 == 1
    scale_word = sum(c << (4 * c) for c in range(n))  # scale code c for column c
    invperm = torch.arange(k - 1, -1, -1, dtype=torch.int32)
    t = Exl2Tensors(
        q_weight=q_weight,
        q_scale=torch.tensor([[_signed(scale_word)]], dtype=torch.int32),
        q_scale_max=torch.tensor([0.5], dtype=torch.float16),
        q_groups=torch.tensor([3, 0], dtype=torch.int16),
        q_invperm=invperm,
    )
    t.validate("m", k, n)
    assert unpack_bitstream(q_weight, 3, k).tolist() == codes
    scale = torch.tensor([0.5 * (c + 1) ** 2 / 256 for c in range(n)])
    stored = (torch.tensor(codes, dtype=torch.float32) - 4) * scale
    expected = torch.empty(k, n)
    expected[torch.argsort(invperm.long())] = stored  # W[q_perm[r]] = stored row r
    assert torch.equal(dequantize_exl2(t), expected)
    assert torch.equal(dequantize_reference(exl2_to_runtime(t)), expected)


def test_column_packing_by_hand() -> None:
    scale_codes = torch.tensor([[c % 16 for c in range(16)], [15] * 16])
    packed = pack_along_columns(scale_codes, 4)
    words = [
        [_signed(sum((row[8 * w + j]) << (4 * j) for j in range(8))) for w in range(2)]
        for row in scale_codes.tolist()
    ]
    assert packed.tolist() == words and packed[1, 0] == -1
    assert torch.equal(unpack_along_columns(packed, 4, 16).long(), scale_codes)


def test_segment_planes_split_codes() -> None:
    codes = torch.arange(64).view(64, 1).repeat(1, 4)
    seg = make_segment(codes, 6, 10)
    assert [(p.bits, p.shift) for p in seg.planes] == [(4, 2), (2, 0)]
    assert (seg.row_start, seg.row_end) == (10, 74)
    assert torch.equal(seg.codes().long(), codes)
    assert torch.equal(unpack_plane(seg.planes[0].packed, 4, 64).long(), codes >> 2)


def test_exl2_scale_rounding_matches_exllamav2_fp16_ops() -> None:
    """scale = fp16(fp16((s+1)^2) * fp16(q_scale_max / 256)), subnormal range included."""
    smax = torch.tensor([0.001, 0.03, 0.5], dtype=torch.float16)  # 0.001/256 is subnormal
    codes = torch.arange(16).repeat(3, 1)
    got = exl2_scales(pack_along_columns(codes, 4), smax, 16)
    pre = smax * (1 / 256)  # fp16 tensor op, as ext.py's in-place multiply
    want = torch.tensor([(s + 1) ** 2 for s in range(16)], dtype=torch.float16)[None] * pre[:, None]
    assert got.dtype == torch.float16 and torch.equal(got, want)


# ------------------------------------------------------------------------------------ EXL2

EXL2_CASES = {
    # name: (bits per group, group sizes, out_features, act-order)
    **{f"{b}bit": ([b] * 3, [64, 64, 32], 96, b % 2 == 0) for b in (2, 3, 4, 5, 6, 8)},
    "mix_8_to_2": ([8, 6, 5, 4, 3, 2], [32, 32, 32, 32, 32, 24], 64, True),
    "mix_4_3_padded_n": ([4, 3, 3], [128, 64, 8], 100, True),
    "mix_6_5": ([6, 5, 5], [32, 64, 40], 32, False),
    "2bit_16_row_groups": ([3, 2, 2, 2], [32, 16, 16, 20], 64, True),
}


def _exl2_case(name: str) -> tuple[dict, torch.Tensor, torch.Tensor, list[int], list[int]]:
    bits, sizes, n, act_order = EXL2_CASES[name]
    k = sum(sizes)
    gen = torch.Generator().manual_seed(len(name) * 7 + k)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    perm = torch.randperm(k, generator=gen) if act_order else None
    tensors = quantize_rtn_exl2(weight, bits, sizes, perm=perm, bias=bias)
    return tensors, weight, bias, bits, sizes


@pytest.mark.parametrize("case", list(EXL2_CASES))
def test_exl2_round_trip_and_runtime(case: str) -> None:
    tensors, weight, bias, bits, sizes = _exl2_case(case)
    n, k = weight.shape
    w = -(-n // 32) * 32
    assert set(tensors) == {"q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "bias"}
    words = sum(packed_rows(r, b) for r, b in zip(sizes, bits, strict=True))
    assert tensors["q_weight"].shape == (words, w) and tensors["q_scale"].shape == (
        len(bits),
        w // 8,
    )
    assert tensors["q_groups"].dtype == torch.int16
    t = Exl2Tensors.from_dict({"layer." + key: v for key, v in tensors.items()}, prefix="layer.")
    t.validate("layer", k, n)

    # Unpack every group and the scale codes, pack again: the same tensors.
    groups = t.groups()
    codes = torch.cat(
        [
            unpack_bitstream(t.q_weight[g.qrow_start : g.qrow_end], g.bits, g.row_end - g.row_start)
            for g in groups
        ]
    )
    scale_codes = unpack_along_columns(t.q_scale, 4, w)
    # Padded columns hold scale code 15 and the zero point, as the converter writes them.
    zero_point = torch.tensor([2 ** (b - 1) for b in bits]).repeat_interleave(torch.tensor(sizes))
    assert bool((scale_codes[:, n:] == 15).all())
    assert bool((codes[:, n:].long() == zero_point[:, None]).all())
    again = pack_exl2(
        codes[:, :n], bits, sizes, scale_codes[:, :n], t.q_scale_max, t.q_invperm, bias
    )
    assert again.keys() == tensors.keys()
    assert all(torch.equal(again[key], tensors[key]) for key in tensors)

    # Reference dequantizer against the runtime layout, and the quantization error.
    ref = dequantize_exl2(t, out_features=n)
    qw = exl2_to_runtime(t, out_features=n)
    qw.validate()
    assert [s.bits for s in qw.segments] == sorted(set(bits), reverse=True)
    assert (qw.perm is None) == (not EXL2_CASES[case][3])
    assert torch.allclose(dequantize_reference(qw), ref, rtol=0, atol=1e-6)
    err = (ref - weight.t()).pow(2).mean().sqrt() / weight.pow(2).mean().sqrt()
    assert err < 2.0 ** (1 - min(bits))
    x = torch.randn(3, k)
    y = quant_matmul_reference(x, qw)
    assert torch.allclose(y, x @ ref + bias.half().float(), atol=1e-4)


def test_exl2_rtn_error_shrinks_with_bits() -> None:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    errors = []
    for b in (2, 3, 4, 5, 6, 8):
        t = Exl2Tensors.from_dict(quantize_rtn_exl2(weight, b, 64))
        err = (dequantize_exl2(t) - weight.t()).pow(2).mean().sqrt() / weight.std()
        assert err < 2.0 ** (1 - b), (b, err)
        errors.append(float(err))
    assert all(hi > 1.6 * lo for hi, lo in itertools.pairwise(errors)), errors


def test_exl2_power_of_two_segments_reuse_q_weight() -> None:
    tensors = quantize_rtn_exl2(torch.randn(64, 96), [8, 4, 2], [32, 32, 32])
    qw = exl2_to_runtime(Exl2Tensors.from_dict(tensors))
    packed = torch.cat([s.planes[0].packed for s in qw.segments])
    assert torch.equal(packed, tensors["q_weight"])


def test_exl2_k_limit_is_exllamav2s_uint16_permutation() -> None:
    def linear(k: int) -> Exl2Tensors:
        return Exl2Tensors(
            q_weight=torch.zeros(packed_rows(k, 2), 32, dtype=torch.int32),
            q_scale=torch.zeros(1, 4, dtype=torch.int32),
            q_scale_max=torch.ones(1, dtype=torch.float16),
            q_groups=torch.tensor([2, 0], dtype=torch.int16),
            q_invperm=torch.arange(k, dtype=torch.int32),
        )

    linear(EXL2_MAX_IN_FEATURES).validate("m", EXL2_MAX_IN_FEATURES, 32)  # indices <= 65535
    with pytest.raises(QuantFormatError, match=r"^m\.q_invperm: in_features must be"):
        linear(EXL2_MAX_IN_FEATURES + 1).validate("m", EXL2_MAX_IN_FEATURES + 1, 32)


EXL2_CORRUPTIONS = {  # name: (tensor named, message fragment, change)
    "q_weight_dtype": (
        "q_weight",
        "dtype must be int32",
        lambda t: {"q_weight": t.q_weight.float()},
    ),
    "q_weight_width": ("q_weight", "has 32 columns", lambda t: {"q_weight": t.q_weight[:, :32]}),
    "q_weight_rows": ("q_groups", "q_weight has 13 rows", lambda t: {"q_weight": t.q_weight[:-1]}),
    "q_scale_shape": ("q_scale", "shape must be [3, 8]", lambda t: {"q_scale": t.q_scale[:, :-1]}),
    "q_scale_max_dtype": (
        "q_scale_max",
        "float16",
        lambda t: {"q_scale_max": t.q_scale_max.float()},
    ),
    "q_groups_dtype": ("q_groups", "int16", lambda t: {"q_groups": t.q_groups.int()}),
    "q_groups_odd": ("q_groups", "pairs", lambda t: {"q_groups": t.q_groups[:-1]}),
    "bits_unsorted": (
        "q_groups",
        "group bits must be non-increasing, got 6 then 8",
        lambda t: {"q_groups": _set(t.q_groups, 2, 8)},
    ),
    "bits_7": ("q_groups", "group 0 has 7 bits", lambda t: {"q_groups": _set(t.q_groups, 0, 7)}),
    "bits_1": ("q_groups", "group 2 has 1 bits", lambda t: {"q_groups": _set(t.q_groups, 4, 1)}),
    "bits_9": ("q_groups", "group 0 has 9 bits", lambda t: {"q_groups": _set(t.q_groups, 0, 9)}),
    "offset": ("q_groups", "rows 0..5", lambda t: {"q_groups": _set(t.q_groups, 3, 5)}),
    "invperm_dup": ("q_invperm", "1 appears 2x", lambda t: {"q_invperm": _set(t.q_invperm, 0, 1)}),
    "invperm_range": ("q_invperm", "span 1..96", lambda t: {"q_invperm": t.q_invperm + 1}),
    "invperm_length": ("q_invperm", "[96]", lambda t: {"q_invperm": t.q_invperm[:-1]}),
    "invperm_dtype": ("q_invperm", "int32", lambda t: {"q_invperm": t.q_invperm.long()}),
    "bias_shape": ("bias", "[64]", lambda t: {"bias": torch.zeros(7, dtype=torch.float16)}),
}


def _set(t: torch.Tensor, index: int, value: int) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


@pytest.fixture(scope="module")
def exl2_linear() -> dict[str, torch.Tensor]:
    # groups: 6 (32 rows), 4 (32 rows), 4 (32 rows): q_groups [6, 0, 4, 6, 4, 10]
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    return quantize_rtn_exl2(weight, [6, 4, 4], 32, bias=torch.zeros(64))


@pytest.mark.parametrize("corruption", list(EXL2_CORRUPTIONS))
def test_exl2_corruption_names_the_tensor(corruption: str, exl2_linear: dict) -> None:
    name = "model.layers.0.mlp.up_proj"
    good = Exl2Tensors.from_dict(exl2_linear)
    good.validate(name, 96, 64)
    tensor, fragment, change = EXL2_CORRUPTIONS[corruption]
    bad = Exl2Tensors(**{**good.to_dict(), **change(good)})
    with pytest.raises(QuantFormatError, match=rf"^{re.escape(name)}\.{tensor}: ") as e:
        bad.validate(name, 96, 64)
    assert fragment in str(e.value)


# ------------------------------------------------------------------------------------ GPTQ


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("act_order", [False, True], ids=["seq", "act"])
def test_gptq_round_trip_and_runtime(
    bits: int, group_size: int, sym: bool, v2: bool, act_order: bool
) -> None:
    k, n = 256, 32
    gen = torch.Generator().manual_seed(bits + group_size)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    tensors = quantize_rtn_gptq(
        weight, bits, group_size, sym=sym, act_order=act_order, v2=v2, bias=bias
    )
    fmt = "gptq_v2" if v2 else "gptq"
    t = GptqTensors.from_dict(tensors, bits=bits, checkpoint_format=fmt)
    t.validate("m", k, n)
    groups = 1 if group_size == -1 else k // group_size
    assert t.qweight.shape == (k * bits // 32, n) and t.qzeros.shape == (groups, n * bits // 32)
    if sym:  # AutoGPTQ's symmetric zero 2^(b-1); v1 stores it minus one
        nibble = (1 << (bits - 1)) - (0 if v2 else 1)
        word = sum(nibble << s for s in range(0, 32, bits))
        assert bool((t.qzeros == _signed(word)).all())

    # Unpack and pack again: the same tensors.
    codes = unpack_bitstream(t.qweight, bits, k)
    stored = unpack_along_columns(t.qzeros, bits, n)
    assert torch.equal(pack_bitstream(codes, bits), t.qweight)
    assert torch.equal(pack_along_columns(stored, bits), t.qzeros)
    assert torch.equal(t.zero_points(), stored.int() + (0 if v2 else 1))

    ref = dequantize_gptq(t)
    qw = gptq_to_runtime(t)
    qw.validate()
    assert (qw.perm is None) == (not act_order or group_size == -1)
    got = dequantize_reference(qw)
    if sym:
        assert torch.allclose(got, ref, rtol=0, atol=1e-6)
    else:  # zero * scale is rounded to fp16 in the runtime layout
        zs = t.zero_points().float() * t.scales.float()
        tol = (zs.abs() * 2.0**-11).amax() + 1e-7
        assert (got - ref).abs().max() <= tol
    err = (ref - weight.t()).pow(2).mean().sqrt() / weight.std()
    assert err < (0.15 if bits == 4 else 0.01)
    x = torch.randn(2, k, dtype=torch.float16)
    y = quant_matmul_reference(x, qw)
    assert y.dtype == torch.float16
    assert torch.allclose(y.float(), x.float() @ got + bias.half().float(), rtol=1e-3, atol=1e-3)

    if not act_order:  # without g_idx the group size comes from the shapes
        no_idx = GptqTensors.from_dict({**tensors, "g_idx": None}, bits=bits, checkpoint_format=fmt)
        no_idx.validate("m", k, n)
        assert torch.equal(dequantize_gptq(no_idx), ref)


def test_gptq_layout_by_hand() -> None:
    codes = [[(5 * i + c) % 16 for c in range(8)] for i in range(16)]
    qweight = _stream_by_hand(codes, 4)  # row j of a word at bits 4j
    qzeros = torch.tensor([[_signed(0xF7777770)]], dtype=torch.int32)  # zeros - 1 by column
    t = GptqTensors(qweight, qzeros, torch.full((1, 8), 0.5, dtype=torch.float16))
    t.validate("m", 16, 8)
    zero = [1, 8, 8, 8, 8, 8, 8, 16]  # v1: stored nibble + 1, 15 -> 16 as AutoGPTQ reads it
    want = (torch.tensor(codes, dtype=torch.float32) - torch.tensor(zero)) * 0.5
    assert torch.equal(dequantize_gptq(t), want)


def test_gptq_act_order_runtime_sorts_rows_by_group() -> None:
    tensors = quantize_rtn_gptq(torch.randn(32, 128), 4, 32, act_order=True)
    t = GptqTensors.from_dict(tensors)
    qw = gptq_to_runtime(t)
    assert qw.perm is not None
    assert torch.equal(qw.perm.long(), torch.argsort(t.g_idx.long(), stable=True))
    assert torch.equal(qw.row_group.long(), torch.arange(128) // 32)


def test_infer_group_size() -> None:
    assert infer_group_size(4096, 32) == 128  # the exllamav2 power-of-two rule
    assert infer_group_size(600, 5) == 128  # AutoGPTQ group 128 with a short last group
    assert infer_group_size(384, 4) == 96  # not a power of two: k / G
    assert infer_group_size(4096, 1) == 4096
    with pytest.raises(ValueError):
        infer_group_size(100, 60)


GPTQ_CORRUPTIONS = {
    "bits_3": ("qweight", {"bits": 3}),
    "qweight_shape": ("qweight", {"qweight": torch.zeros(15, 32, dtype=torch.int32)}),
    "qweight_dtype": ("qweight", {"qweight": torch.zeros(16, 32, dtype=torch.int64)}),
    "qzeros_shape": ("qzeros", {"qzeros": torch.zeros(4, 3, dtype=torch.int32)}),
    "scales_shape": ("scales", {"scales": torch.zeros(4, 31, dtype=torch.float16)}),
    "g_idx_range": ("g_idx", {"g_idx": torch.full((128,), 4, dtype=torch.int32)}),
    "g_idx_length": ("g_idx", {"g_idx": torch.zeros(127, dtype=torch.int32)}),
    "format": ("qzeros", {"checkpoint_format": "gptq_v3"}),
    "bias_shape": ("bias", {"bias": torch.zeros(33, dtype=torch.float16)}),
}


@pytest.mark.parametrize("corruption", list(GPTQ_CORRUPTIONS))
def test_gptq_corruption_names_the_tensor(corruption: str) -> None:
    good = GptqTensors.from_dict(quantize_rtn_gptq(torch.randn(32, 128), 4, 32))
    good.validate("m.q_proj", 128, 32)
    tensor, change = GPTQ_CORRUPTIONS[corruption]
    fields = {**good.to_dict(), "bits": 4, "checkpoint_format": "gptq", **change}
    with pytest.raises(QuantFormatError, match=rf"^m\.q_proj\.{tensor}: "):
        GptqTensors(**fields).validate("m.q_proj", 128, 32)


# --------------------------------------------------------------------------- runtime layout


@pytest.fixture(scope="module")
def exl2_act_order() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(6)
    weight, perm = torch.randn(64, 96, generator=gen), torch.randperm(96, generator=gen)
    return quantize_rtn_exl2(weight, [5, 3, 3], 32, perm=perm, bias=torch.ones(64))


def test_runtime_to_device_and_dtypes(exl2_act_order: dict) -> None:
    qw = exl2_to_runtime(Exl2Tensors.from_dict(exl2_act_order))
    moved = qw.to("cpu")
    moved.validate()
    assert torch.equal(dequantize_reference(moved), dequantize_reference(qw))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(4, 2, 96).to(dtype)
        assert quant_matmul_reference(x, qw).shape == (4, 2, 64)
        assert quant_matmul_reference(x, qw).dtype == dtype


RUNTIME_BREAKAGES = {
    "plane_split": lambda qw: setattr(qw.segments[0], "planes", qw.segments[0].planes[:1]),
    "plane_dtype": lambda qw: setattr(qw.segments[0].planes[0], "packed", torch.zeros(2, 64)),
    "plane_rows": lambda qw: setattr(
        qw.segments[0].planes[0], "packed", qw.segments[0].planes[0].packed[:-1].contiguous()
    ),
    "scales_dtype": lambda qw: setattr(qw, "scales", qw.scales.float()),
    "row_group": lambda qw: setattr(qw, "row_group", qw.row_group.flip(0).contiguous()),
    "perm": lambda qw: setattr(qw, "perm", torch.zeros_like(qw.perm)),
    "coverage": lambda qw: setattr(qw, "segments", qw.segments[1:]),
}


@pytest.mark.parametrize("breakage", list(RUNTIME_BREAKAGES))
def test_runtime_validate_refuses_malformed(breakage: str, exl2_act_order: dict) -> None:
    qw = exl2_to_runtime(Exl2Tensors.from_dict(exl2_act_order))
    qw.validate()
    RUNTIME_BREAKAGES[breakage](qw)
    with pytest.raises(AssertionError, match="QuantizedWeight"):
        qw.validate()
