"""Slicing one linear for tensor parallelism, dense or quantized, without dequantizing.

Every quantized format (EXL2 of any bit mix, GPTQ with or without act-order) is already
repacked into the runtime layout (docs/quant_layout.md) when the model loads, so sharding
works on that layout and is exact: the shard holds the very codes, scales and zero points
of the rows/columns it keeps, and runs through the same kernels.

- Columns (out_features, the n axis: q/k/v/gate/up): n is never packed, so a shard takes
  columns of every bit plane, of scales and zeros, and of the bias. Any index set works,
  which is how a fused qkv_proj or gate_up_proj takes its q, k and v (gate, up) pieces.
- Rows (in_features, the k axis: o/down): codes are packed along k in *permuted* order
  (act-order), so the rows a rank keeps may be scattered through the permutation. The
  shard unpacks the codes of those rows, segment by segment, and repacks them at the same
  bit width; their groups keep their scales and zero points (empty groups are dropped),
  and the permutation is renumbered into the rank's local input. Bits never change.

The per-row choice of rows is the caller's (see transform.py): for o_proj the rank's
heads fix the input indices; for down_proj the rank may pick whole groups, so its MLP
columns follow the down projection's groups (keeping the kernels' per-group fast path).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.modules import Linear
from engine.quant.bitpack import make_segment
from engine.quantized_linear import QuantizedLinear
from kernels.quant_matmul.layout import Plane, QuantizedWeight, Segment, compact_zero_points


def _cols(t: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    return t.index_select(t.dim() - 1, cols.to(t.device)).contiguous()


def quantized_columns(qw: QuantizedWeight, cols: torch.Tensor) -> QuantizedWeight:
    """The weight restricted to output columns `cols` (in that order)."""
    segments = [
        Segment(
            s.bits,
            s.row_start,
            s.row_end,
            [Plane(p.bits, p.shift, _cols(p.packed, cols)) for p in s.planes],
        )
        for s in qw.segments
    ]
    return QuantizedWeight(
        in_features=qw.in_features,
        out_features=len(cols),
        perm=qw.perm,
        segments=segments,
        scales=_cols(qw.scales, cols),
        zeros=compact_zero_points(_cols(qw.zeros, cols)),  # one per group stays so
        row_group=qw.row_group,
        bias=None if qw.bias is None else _cols(qw.bias, cols),
    )


def quantized_rows(
    qw: QuantizedWeight, rows: torch.Tensor, perm: torch.Tensor | None, *, keep_bias: bool
) -> QuantizedWeight:
    """The weight restricted to permuted rows `rows` (increasing), repacked losslessly.

    `perm` is the new activation permutation over the rank's local input (None: the rank's
    input already comes in the order of `rows`). The bias is kept on one rank only, since
    the partial outputs of all ranks are summed."""
    rows = rows.to(torch.long)
    if rows.numel() == 0:
        raise ValueError("a row shard needs at least one row")
    if bool((rows[1:] <= rows[:-1]).any()):
        raise ValueError("shard rows must be increasing (the permuted order is kept)")
    groups = qw.row_group.long()[rows.to(qw.row_group.device)]
    used, local_group = torch.unique_consecutive(groups, return_inverse=True)
    segments: list[Segment] = []
    start = 0
    for seg in qw.segments:
        inside = rows[(rows >= seg.row_start) & (rows < seg.row_end)] - seg.row_start
        if inside.numel() == 0:
            continue
        segments.append(_segment_rows(seg, inside, start))
        start += inside.numel()
    return QuantizedWeight(
        in_features=rows.numel(),
        out_features=qw.out_features,
        # The local permutation is computed on the host (rows_of_inputs); it goes where the
        # weight is (a rank may cut its shard on its GPU: staging.py).
        perm=None if perm is None else perm.to(qw.scales.device, torch.int32).contiguous(),
        segments=segments,
        scales=qw.scales[used].contiguous(),
        zeros=compact_zero_points(qw.zeros[used]),
        row_group=local_group.to(torch.int32).contiguous(),
        bias=qw.bias if keep_bias else None,
    )


def _runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs [start, end) of consecutive values in increasing `rows`."""
    breaks = (torch.nonzero(rows[1:] != rows[:-1] + 1).flatten() + 1).tolist()
    bounds = [0, *breaks, rows.numel()]
    return [(int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(bounds, bounds[1:], strict=False)]


def _segment_rows(seg: Segment, inside: torch.Tensor, start: int) -> Segment:
    """Rows `inside` (local to `seg`, increasing) of a segment as a new segment at `start`.

    Runs of rows that begin and end on word boundaries of every plane (whole quantization
    groups, as a rule) are sliced word by word; anything else is unpacked and repacked."""
    runs = _runs(inside)
    per_word = [32 // p.bits for p in seg.planes]
    aligned = all(a % w == 0 and (b % w == 0 or b == seg.rows) for a, b in runs for w in per_word)
    if not aligned:
        codes = seg.codes()[inside.to(seg.planes[0].packed.device)]
        return make_segment(codes, seg.bits, start)
    planes = []
    for plane, w in zip(seg.planes, per_word, strict=True):
        words = [plane.packed[a // w : -(-b // w)] for a, b in runs]
        planes.append(Plane(plane.bits, plane.shift, torch.cat(words).contiguous()))
    return Segment(seg.bits, start, start + inside.numel(), planes)


def rows_of_inputs(
    qw: QuantizedWeight, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Permuted rows reading original inputs lo..hi-1, and their permutation over the
    rank's local input x[lo:hi] (None when the weight has no permutation)."""
    if qw.perm is None:
        return torch.arange(lo, hi), None
    perm = qw.perm.long().cpu()
    rows = torch.nonzero((perm >= lo) & (perm < hi)).flatten()
    return rows, perm[rows] - lo


def shard_columns(module: nn.Module, cols: torch.Tensor) -> nn.Module:
    """A column-parallel shard of a Linear / QuantizedLinear: outputs `cols` only."""
    cols = cols.to(torch.long)
    if isinstance(module, QuantizedLinear):
        if int(cols.max()) >= module.out_features:
            raise ValueError(f"column {int(cols.max())} outside {module.out_features} outputs")
        return QuantizedLinear(quantized_columns(module.qweight, cols), len(cols), module.format)
    if isinstance(module, Linear):
        shard = Linear(module.in_features, len(cols), module.bias is not None)
        shard.weight = nn.Parameter(_rows_dense(module.weight, cols), requires_grad=False)
        if module.bias is not None:
            shard.bias = nn.Parameter(_cols(module.bias, cols), requires_grad=False)
        return shard
    raise TypeError(f"cannot shard a {type(module).__name__} by columns")


def _rows_dense(weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return weight.index_select(0, index.to(weight.device)).contiguous()


def shard_rows_dense(module: Linear, inputs: torch.Tensor, *, keep_bias: bool) -> Linear:
    """A row-parallel shard of a dense Linear reading the original inputs `inputs`."""
    shard = Linear(len(inputs), module.out_features, module.bias is not None and keep_bias)
    shard.weight = nn.Parameter(_cols(module.weight, inputs.to(torch.long)), requires_grad=False)
    if module.bias is not None and keep_bias:
        shard.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
    return shard


def shard_rows_quantized(
    module: QuantizedLinear, rows: torch.Tensor, perm: torch.Tensor | None, *, keep_bias: bool
) -> QuantizedLinear:
    qw = quantized_rows(module.qweight, rows, perm, keep_bias=keep_bias)
    return QuantizedLinear(qw, module.out_features, module.format)
