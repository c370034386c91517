"""Quantized matmul y = x @ W + bias over Kestrel's runtime layout: the op `quant_matmul`.

Contract (docs/quant_layout.md is the layout; layout.py holds the dataclasses, reference.py
the torch references; k = in_features, n = out_features):

    quant_matmul(x [..., k] float16/bfloat16/float32, qw) -> [..., n] in x.dtype
    quant_matmul_triton(x, qw, *, path="auto") -> the same through the kernels
    quant_matmul_silu_mul(x, qw) -> silu(gate) * up [..., n / 2] of x @ W = [gate | up]
        (a gated MLP's gate_up projection): bits of quant_matmul + kernels.silu_mul
    dequantize_triton(qw, *, dtype=float16, permuted=False) -> W [k, n] in dtype,
        original row order (as dequantize_reference) unless permuted=True

`quant_matmul` (dispatch.py) runs the kernels on CUDA tensors and `quant_matmul_reference` otherwise
(kernels.backend.resolve_backend); `quant_matmul_triton` forces the kernels and lets tests
and benchmarks pick a path. Every path accumulates in float32 and rounds once to x.dtype.

Paths, by the number of activation rows M (thresholds and `choose_path` in paths.py):

* M <= GEMV_MAX_M (decode): `_gemv_kernel` (gemv.py), a fused dequantizing GEMV. It is bound
  by memory and, nearly as much, by instructions per byte, so each packed int32 word is
  loaded once (coalesced along n, 16 bytes per load) and each code costs about two
  instructions per row of x: a chunk of 32 rows is a [words, rows per word, BLOCK_N] tile
  held by the thread that owns the column (lanes and warps lie only along n, so sums over
  rows stay in registers), and codes are masked in place and used as float32 denormals (see
  `_gemv_plane`). The planes of a segment are separate bit matrices: code = sum of plane <<
  shift, so each adds its own dot product. Scale and zero apply once per chunk and column:
  sum_r x_r (c_r s - z) = s * sum_r x_r c_r - z * sum_r x_r, which needs every chunk inside
  one row group. That holds for EXL2 and GPTQ (groups of 32k rows, bit widths changing only
  at group boundaries) and is checked once per weight on the host (`chunks_in_groups`);
  other groupings take a per-row path. Every thread needs every row of x of its chunk: it
  loads them once per chunk for all planes and the zero term, in 8-byte words where the rows
  are contiguous and aligned (`reads_x_in_words`), and whole chunks and column tiles launch
  without masks. x is gathered through perm in the kernel, unless the slot sum that wrote x
  stored it in the weight's row order already (`x_in_row_order`: slot_sum.py's scatter,
  split_k.row_order; the folded decode path does so for qkv, gate_up and down_proj). The
  grid is (column tiles, split-K slices) with about GemvConfig.programs_per_sm programs per
  SM, so n = k = 4096 still fills 132 SMs. With GemvConfig.prefetch each program loads the
  next chunk's words while it works on this one, and the first chunk's before it waits for
  the previous kernel (programmatic dependent launch, kernels/backend.py): weights are never
  written, so their loads may overlap the tail of whatever ran before. Where a program
  walks enough chunks in about one wave (GemvConfig.stages, `_gemv_stages`), Triton's
  software pipeline issues every load of a chunk two chunks ahead by cp.async into shared
  memory, so more bytes are in flight than the registers could hold.
* GEMV_MAX_M < M < DEQUANT_MIN_M (batched decode, speculative verification, short
  prefill chunks): `_dot_kernel` (dot.py), the same split-K structure with
  a [BLOCK_M, BLOCK_K] x tile and a [BLOCK_K, BLOCK_N] code tile on the tensor cores
  (tl.dot, wgmma on Hopper, float32 accumulation, software-pipelined loads). Codes
  (< 256) are exact in fp16/bf16, so the tensor cores see no rounding of W:
  acc += ((x @ codes) - rowsum(x) * z) * s. For fp16 x with uint8 zero points (GPTQ up
  to 8-bit v2, EXL2) the operand is instead (codes - z) * s in fp16 (DotConfig.fold), the
  very W that dequantization writes: the MMAs then chain across chunks with no epilogue.
* M >= DEQUANT_MIN_M (prefill): `dequantize_triton` (dequantize.py) writes W in the
  *original* row order (row i lands at perm[i]: whole rows, so no cost), then cuBLAS does
  x @ W + bias: no gathered copy of x. W is a fresh tensor from torch's caching allocator,
  which hands the same block back on the next call of that size (a reusable scratch without
  a global).

Reduction: every split-K program (of every segment's launch) stores its float32 partial
in its own slot of a per-device workspace, [slots, M, n], and the slots are added in slot
order 0, 1, 2, ... and rounded once into y's dtype. The order of the float32 additions is
fixed, so the sum does not depend on which program finished first and decode is bitwise
reproducible for every output dtype (issue 31: float32 atomics flipped the last bit from
run to run and, rarely, the rounding to 16 bits and a token). The decode GEMV leaves the
sum to a kernel of its own launched right after it (slot_sum.py: a few hundred small
programs, every slot's load in flight, resident before the GEMV ends through programmatic
dependent launch): summed by each column tile's last program instead, a few programs read
every partial alone at the end of the GEMV and decode lost 15%. The mid-M path's tiles
are many and small, so there the last program of each tile (an atomic counter per tile,
set back to 0 by that program) adds its tile's slots. One launch per Segment (at most 6;
the plane layout is a compile-time constant of the unpacking code), each with its own
range of slots; the first one adds the bias. No zero-fill: every slot read is written by
the same call. The partials stay in L2 (written once, read once).

Modules: layout.py the runtime layout; reference.py the torch references; paths.py the
path choice and the argument checks; dispatch.py the public functions; gemv.py the decode
GEMV (`GemvConfig`, `launch_gemv`), slot_sum.py the sum of its partials and gemv_share.py
its opening to other kernels' partials (LoRA's expand: `GemvShare`); dot.py the mid-M
tensor-core path (`DotConfig`, `_DOT_CONFIGS`, `launch_dot`); dequantize.py the
dequantization and dequantize + cuBLAS; what several kernels share: tiles.py inside the
kernels (segment codes, zero points, the workspace's slots), split_k.py on the host (plane
arguments, the split-K plan, the workspace).

Loops have constexpr trip counts: Triton 3.6's interpreter fails on runtime loop bounds
under numpy >= 2.4 (triton-lang/triton#9171), and the tests run the kernels there.
"""

from kernels.quant_matmul.dequantize import dequantize_triton
from kernels.quant_matmul.dispatch import (
    quant_matmul,
    quant_matmul_silu_mul,
    quant_matmul_triton,
)
from kernels.quant_matmul.layout import QuantizedWeight
from kernels.quant_matmul.reference import dequantize_reference, quant_matmul_reference

__all__ = [
    "QuantizedWeight",
    "dequantize_reference",
    "dequantize_triton",
    "quant_matmul",
    "quant_matmul_reference",
    "quant_matmul_silu_mul",
    "quant_matmul_triton",
]
