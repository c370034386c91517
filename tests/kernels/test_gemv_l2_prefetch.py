"""The decode GEMV's L2 prefetch (GemvConfig.l2_prefetch, kernels/quant_matmul/gemv.py's
`_gemv_prefetch_l2`): before its programmatic-dependent-launch wait each program asks L2 for
every 128-byte line of packed words it will read, so the weight's DRAM reads can run while
the kernels before it finish.

Compiled here for sm_90 without a GPU, in a child process (the suite's kernels run
interpreted, where the inline PTX does not exist): with the setting the PTX holds one
prefetch per thread and chunk, all before the wait, and none without it. Through the
interpreter: the lines each program prefetches are exactly the lines its chunks read. On a
GPU: the
GEMV's sums are bit for bit the same with and without it (a prefetch moves no data into
registers)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl

from helpers.quant_weights import make_weight
from helpers.sm90_compile import compiled_facts
from kernels.quant_matmul import gemv

pytest.importorskip("triton")

_COMPILE = """
import importlib, inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
kernel = importlib.import_module("kernels.quant_matmul.gemv")._gemv_kernel
l2, planes = sys.argv[1] == "1", int(sys.argv[2])
consts = dict(HAS_PERM=False, GROUPED=True, ZERO_PER_GROUP=False, NUM_PLANES=planes,
    P0_BITS=4, P0_SHIFT=0, P1_BITS=2, P1_SHIFT=4, M_ROWS=1, ITERS=4, BLOCK_N=1024,
    BLOCK_K=32, PREFETCH=True, STAGES=3, EVEN_K=True, EVEN_N=True, VEC_X=True, PTX=True,
    USE_PDL=True, L2_PREFETCH=l2)
pointers = {"x_ptr": "*fp16", "out_ptr": "*fp32", "p0_ptr": "*i32", "p1_ptr": "*i32",
            "scales_ptr": "*fp16", "zeros_ptr": "*fp16", "row_group_ptr": "*i32",
            "perm_ptr": "*i32", "bias_ptr": "*fp16"}
names = list(inspect.signature(kernel.fn).parameters)
signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers}
ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
wait = ptx.find("griddepcontrol.wait")
print(json.dumps({"total": ptx.count("prefetch.global.L2"),
                  "before_wait": ptx[:wait].count("prefetch.global.L2"), "wait": wait > 0}))
"""


def _prefetches(l2: bool, planes: int) -> dict:
    return compiled_facts(_COMPILE, str(int(l2)), str(planes), what="the GEMV")


@pytest.mark.parametrize("planes", [1, 2])
def test_every_line_of_the_split_is_prefetched_before_the_wait(planes: int) -> None:
    on, off = _prefetches(True, planes), _prefetches(False, planes)
    assert off["total"] == 0 and on["wait"]
    # Per chunk and plane: (32 rows / rows per word) word rows x 1024 / 32 lines, over
    # 128 threads: 4-bit 4 x 32 = one line a thread, 2-bit 2 x 32 = half (still one
    # instruction a thread: the layout repeats a tile smaller than the block). 4 chunks.
    assert on["total"] == on["before_wait"] == 4 * planes, on


@pytest.mark.gpu
def test_the_prefetch_leaves_the_sums_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    qw = make_weight(4096, 3072, [4, 3], device="cuda", seed=3, perm=False)
    x = torch.randn(1, 4096, dtype=torch.float16, device="cuda")
    results = []
    for l2 in (False, True):
        config = dataclasses.replace(gemv._GEMV_CONFIG, l2_prefetch=l2)
        monkeypatch.setattr(gemv, "_GEMV_CONFIG", config)
        y = torch.empty(1, 3072, dtype=torch.float16, device="cuda")
        gemv.launch_gemv(x, qw, y)
        results.append(y)
    assert torch.equal(results[0], results[1])


@triton.jit
def _lines_kernel(
    out_ptr, plane_stride, seg_rows, rows_per_split, n, BITS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, ITERS: tl.constexpr,
):  # fmt: skip
    """Every program's prefetched line offsets (-1 where not its line), as the GEMV's
    programs compute them: out [n_tiles, splits, ITERS, W, BLOCK_N / 32]."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    k_begin = pid_k * rows_per_split
    k_end = tl.minimum(k_begin + rows_per_split, seg_rows)
    W: tl.constexpr = BLOCK_K // (32 // BITS)
    LINES: tl.constexpr = BLOCK_N // 32
    cell = (tl.arange(0, W)[:, None] * LINES + tl.arange(0, LINES)[None, :]).to(tl.int64)
    program = (pid_n * tl.num_programs(1) + pid_k).to(tl.int64) * ITERS * W * LINES
    for it in tl.static_range(ITERS):
        offsets, ok = gemv._gemv_l2_lines(
            plane_stride, k_begin + it * BLOCK_K, k_end, pid_n, n, BITS, BLOCK_K, BLOCK_N
        )
        tl.store(out_ptr + program + it * W * LINES + cell, tl.where(ok, offsets, -1))


@pytest.mark.parametrize(
    ("bits", "seg_rows", "n"), [(4, 1024, 2048), (2, 928, 1536), (8, 200, 640)]
)
def test_the_prefetched_lines_are_the_lines_the_gemv_reads(bits: int, seg_rows: int, n: int):
    """Every program prefetches exactly the 128-byte lines of packed words that its chunks
    read (`_gemv_plane_words`: word rows of its split before the segment's end, its columns
    before n), a plane stride of whole lines; uneven splits and a partial last column tile
    included. Through the interpreter (the offsets, not the PTX)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the line arithmetic through the Triton interpreter")
    block_k, block_n, iters = 32, 1024, 4
    rpw, stride = 32 // bits, n
    rows_per_split = iters * block_k
    tiles, splits = triton.cdiv(n, block_n), triton.cdiv(seg_rows, rows_per_split)
    words, lines = block_k // rpw, block_n // 32
    out = torch.empty(tiles, splits, iters, words, lines, dtype=torch.int64)
    _lines_kernel[(tiles, splits)](
        out, stride, seg_rows, rows_per_split, n, BITS=bits, BLOCK_K=block_k, BLOCK_N=block_n,
        ITERS=iters,
    )  # fmt: skip
    for tile in range(tiles):
        for split in range(splits):
            got = {int(o) // 32 for o in out[tile, split].flatten() if o >= 0}
            k_begin = split * rows_per_split
            k_end = min(k_begin + rows_per_split, seg_rows)
            cols = range(tile * block_n, min((tile + 1) * block_n, n))
            read = {
                (row * stride + c) // 32
                for row in range(k_begin // rpw, -(-k_end // rpw))
                for c in cols
            }
            assert got == read, (tile, split)
