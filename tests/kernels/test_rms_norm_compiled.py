"""The norm's fixed sum of squares compiles to a tree spread over the threads (issue 28).

rms_norm sums its squares in a fixed pairwise tree (kernels/rms_norm.py pairwise_sum), so a
row summed in chunks elsewhere (the decode GEMV's folded norm) gets the same bits. Written
as a tl.split per level, that tree compiled for sm_90 to a copy of the whole row into every
thread and all 4,095 adds in each (13,206 PTX instructions for a 4,096 row): every norm
that still launches, prefill's above all, would have been several times slower. Compiled
here for sm_90 without a GPU, in a child process (the suite's kernels run interpreted);
the counts are the generated code's, not a timing."""

from __future__ import annotations

import pytest

from helpers.sm90_compile import compiled_facts

pytest.importorskip("triton")

_COMPILE = """
import importlib, inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
kernel = importlib.import_module("kernels.rms_norm")._rms_norm_kernel
consts = {"UNIT_OFFSET": False, "HAS_RESIDUAL": True, "SINGLE_PASS": True,
          "BLOCK_D": int(sys.argv[1]), "N_BLOCKS": 1, "EMULATE_BF16": False, "USE_PDL": True}
signature = {n: "constexpr" if n in consts else ("*fp16" if n.endswith("_ptr") else "i32")
             for n in inspect.signature(kernel.fn).parameters}
ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
print(json.dumps({"adds": ptx.count("add.f32"), "shuffles": ptx.count("shfl")}))
"""


def _counts(block_d: int) -> dict[str, int]:
    return compiled_facts(_COMPILE, str(block_d), what="rms_norm")


@pytest.mark.parametrize("block_d", [4096, 8192])
def test_each_thread_adds_only_its_share_of_the_row(block_d: int) -> None:
    counts = _counts(block_d)
    # 8 warps x 32 threads: a thread's own elements, then one add per level across threads.
    # The per-level split compiled to block_d - 1 adds in every thread.
    assert counts["adds"] < block_d // 16, f"{counts} for a {block_d} row"
    assert counts["shuffles"] > 0  # the levels across threads are warp shuffles
