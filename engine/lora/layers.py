"""Modules that add LoRA deltas to a base layer, and the per-forward batch they read.

`LoraLinear` wraps any linear (dense `Linear` or `QuantizedLinear`; the delta is applied
unmerged on every weight format): y = base(x), then `kernels.lora_matmul` adds each row's
adapters. Decode steps on a quantized base fold the delta into the base's GEMV instead
(see `LoraLinear._decode`). `LoraEmbedding` wraps `embed_tokens` for
adapters that replace it (modules_to_save). Both are called with the forward's
`LoraBatch` (engine/lora/batch.py, carried by `ForwardBatch.lora`), as every projection
is; with None (no request in the step uses an adapter) they are the base layer plus one
check, and a layer no loaded adapter targets is never wrapped.

A modules_to_save replacement W' at scale c is applied as y + c * (x W'^T - y): the
replacement itself at c = 1 (what peft does), the base at 0, in between a blend. It runs
in torch over the rows that use it, so steps that need it run eagerly (not as a graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.linears import linear_features
from engine.lora.batch import LoraBatch, LoraSegments
from engine.quantized_linear import QuantizedLinear
from kernels.activation import silu_mul as silu_mul_op
from kernels.lora_matmul import (
    lora_expand,
    lora_expand_into_gemv,
    lora_matmul,
    lora_partials_shape,
    lora_shrink,
)
from kernels.quant_matmul.gemv_share import finish_gemv_shared, gemv_share, launch_gemv_shared

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, *, head: bool) -> None:
        super().__init__()
        self.base = base
        self.head = head  # lm_head sees only the logits rows
        self.in_features, self.out_features = linear_features(base)
        self.lora_a: torch.Tensor | None = None  # [L, R, in]
        self.lora_b: torch.Tensor | None = None  # [L, out, R]
        self.slot_map: torch.Tensor | None = None  # [S] int32: slot -> index in a/b, or -1
        self.replacements: dict[int, torch.Tensor] = {}  # slot -> weight [out, in]

    @property
    def empty(self) -> bool:
        return self.lora_a is None and not self.replacements

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        if lora is None:
            base: torch.Tensor = self.base(x)
            return base
        seg = lora.head if self.head else lora.body
        if self.lora_a is not None and seg.max_len == 1 and x.is_cuda:
            return self._decode(x, seg)
        x2 = x.reshape(-1, self.in_features)
        y = self._base_and_replacements(x, x2, seg)
        if self.lora_a is not None:
            assert self.lora_b is not None and self.slot_map is not None  # set with lora_a
            lora_matmul(
                y.view(-1, self.out_features),
                x2,
                self.lora_a,
                self.lora_b,
                self.slot_map,
                *seg.on(x.device),
                max_seg_len=seg.max_len,
            )
        return y

    def forward_silu_mul(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """silu(gate) * up of the adapted output [gate | up] (a gated MLP's gate_up_proj):
        the bits of `kernels.silu_mul` on the halves of `forward(x, lora)`. The base's own
        fused product without adapters; in a decode step on a quantized base at GEMV sizes
        the slot sum after the join takes the product (`_decode`); otherwise the two ops."""
        if lora is None:
            fused = getattr(self.base, "forward_silu_mul", None)
            if fused is not None:
                out: torch.Tensor = fused(x)
                return out
        else:
            seg = lora.head if self.head else lora.body
            if self.lora_a is not None and seg.max_len == 1 and x.is_cuda:
                return self._decode(x, seg, silu_mul=True)
        gate, up = self.forward(x, lora).chunk(2, dim=-1)
        return silu_mul_op(gate, up)

    def _base_and_replacements(
        self, x: torch.Tensor, x2: torch.Tensor, seg: LoraSegments
    ) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        if y.stride(-1) != 1:
            y = y.contiguous()
        y2 = y.view(-1, self.out_features)
        # Replacement first: a LoRA on the same module adds to the replaced weight.
        for slot, weight in self.replacements.items():
            found = seg.rows_using(slot)
            if found is not None:
                rows, scale = (t.to(y.device) for t in found)
                own = F.linear(x2[rows], weight)
                y2[rows] = y2[rows] + scale[:, None].to(y.dtype) * (own - y2[rows])
        return y

    def _decode(
        self, x: torch.Tensor, seg: LoraSegments, *, silu_mul: bool = False
    ) -> torch.Tensor:
        """A decode step on CUDA (one row per segment): the shrink, then the expand, each
        one wave of small loads (kernels.lora_matmul). On a quantized base at GEMV sizes the
        expand stores its terms into a partial slot of the GEMV (GemvShare), so y is written
        once, by the GEMV's slot sum after the join. While a CUDA graph is captured, the
        LoRA kernels go on a side stream: in the graph they overlap the base matmul (they
        need only x), which hides them. Eager steps keep one stream: a switch costs more
        host time than it hides. `silu_mul` (forward_silu_mul): return silu(gate) * up of
        y = [gate | up], taken by that slot sum where there is one."""
        assert self.lora_a is not None and self.lora_b is not None and self.slot_map is not None
        x2 = x.reshape(-1, self.in_features)
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        a, b, slot_map, starts, scales = (
            self.lora_a,
            self.lora_b,
            self.slot_map,
            *seg.on(x.device),
        )
        partials = torch.empty(
            lora_partials_shape(self.in_features, a.shape[1], scales.shape[0], scales.shape[1]),
            dtype=torch.float32,
            device=x.device,
        )
        share = None
        base = self.base
        # A padded quantized output ([gate | up | pad]) would split in the wrong place.
        fits = not silu_mul or (
            isinstance(base, QuantizedLinear) and base.qweight.out_features == self.out_features
        )
        if isinstance(base, QuantizedLinear) and not self.replacements and fits:
            share = gemv_share(x2, base.qweight, silu_mul=silu_mul)
        main = torch.cuda.current_stream(x.device)
        capturing = torch.cuda.is_current_stream_capturing()
        side = _side_stream(x.device) if capturing else main
        if capturing:
            side.wait_stream(main)
        with torch.cuda.stream(side):
            lora_shrink(x2, a, slot_map, starts, scales, out=partials)
            if share is not None:
                lora_expand_into_gemv(share, partials, b, slot_map, starts, scales)
        if share is not None:
            assert isinstance(base, QuantizedLinear)  # a share is made for a quantized base
            launch_gemv_shared(x2, base.qweight, share)
            width = share.y.shape[1] if silu_mul else self.out_features
            y = share.y[:, :width].reshape(*x.shape[:-1], width)
        else:
            y = self._base_and_replacements(x, x2, seg)
        if capturing:
            main.wait_stream(side)
        if share is not None:
            finish_gemv_shared(share)  # after the join: it sums the expand's slot too
            return y
        lora_expand(y.view(-1, self.out_features), partials, b, slot_map, starts, scales)
        if silu_mul:
            gate, up = y.chunk(2, dim=-1)
            return silu_mul_op(gate, up)
        return y

    def extra_repr(self) -> str:
        count = 0 if self.lora_a is None else self.lora_a.shape[0]
        return f"loras={count}, replacements={sorted(self.replacements)}"


class LoraEmbedding(nn.Module):
    """embed_tokens with per-request replacement tables (modules_to_save)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.replacements: dict[int, torch.Tensor] = {}  # slot -> table [vocab, hidden]

    @property
    def weight(self) -> torch.Tensor:
        # Architectures read the table's dtype and device (and Gemma its scale) from here.
        weight = self.base.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    @property
    def empty(self) -> bool:
        return not self.replacements

    def forward(self, token_ids: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        out: torch.Tensor = self.base(token_ids)
        if lora is None:
            return out
        for slot, table in self.replacements.items():
            found = lora.body.rows_using(slot)
            if found is not None:
                rows, scale = (t.to(out.device) for t in found)
                own = table[token_ids[rows]]
                out[rows] = out[rows] + scale[:, None].to(out.dtype) * (own - out[rows])
        return out
