"""Offline sm_90 compile of the issue-28 kernels (no GPU): catches lowering errors."""

import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, ".")
import importlib

from kernels.quant_matmul import gemv, slot_sum

rn = importlib.import_module("kernels.rms_norm")
T = GPUTarget("cuda", 90, 32)


def comp(fn, types, consts, warps):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {}
    for nm in names:
        sig[nm] = "constexpr" if nm in consts else types.get(nm, "i32")
    c = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=consts), target=T, options={"num_warps": warps}
    )
    ptx = c.asm["ptx"]
    c.info = (len(ptx), ptx.count("ld.global"))
    return c


c = comp(
    slot_sum._slot_sum_residual_kernel,
    {"sums_ptr": "*fp32", "residual_ptr": "*fp16", "h_ptr": "*fp16", "squares_ptr": "*fp32"},
    {"SLOTS": 64, "GROUP": 64, "BLOCK": 32, "USE_PDL": True, "EMULATE_BF16": False},
    1,
)
print("slot_sum_residual ok", c.info)
for bf in ("fp16", "bf16"):
    c = comp(
        rn._rms_norm_kernel,
        {
            "x_ptr": f"*{bf}",
            "residual_ptr": f"*{bf}",
            "weight_ptr": f"*{bf}",
            "out_ptr": f"*{bf}",
            "residual_out_ptr": f"*{bf}",
            "eps": "fp32",
        },
        {
            "UNIT_OFFSET": False,
            "HAS_RESIDUAL": True,
            "SINGLE_PASS": True,
            "BLOCK_D": 4096,
            "N_BLOCKS": 1,
            "EMULATE_BF16": False,
            "USE_PDL": True,
        },
        8,
    )
    print("rms_norm ok", bf, c.info)
for norm in (False, True):
    types = {
        "x_ptr": "*fp16",
        "out_ptr": "*fp32",
        "p0_ptr": "*i32",
        "p1_ptr": "*i32",
        "scales_ptr": "*fp16",
        "zeros_ptr": "*fp16",
        "row_group_ptr": "*i32",
        "perm_ptr": "*i32",
        "bias_ptr": "*fp16",
        "norm_ptr": "*fp16",
        "squares_ptr": "*fp32",
        "norm_eps": "fp32",
    }
    consts = {
        "HAS_PERM": False,
        "GROUPED": True,
        "ZERO_PER_GROUP": False,
        "NUM_PLANES": 1,
        "P0_BITS": 4,
        "P0_SHIFT": 0,
        "P1_BITS": 4,
        "P1_SHIFT": 0,
        "M_ROWS": 1,
        "ITERS": 2,
        "BLOCK_N": 1024,
        "BLOCK_K": 32,
        "PREFETCH": True,
        "USE_PDL": True,
        "NORM": norm,
        "CHUNKS_POW2": 128,
        "UNIT_OFFSET": False,
        "EMULATE_BF16": False,
    }
    c = comp(gemv._gemv_kernel, types, consts, 4)
    print("gemv NORM", norm, c.info)
