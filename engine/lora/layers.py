"""Modules that add LoRA deltas to a base layer, and the per-forward batch they read.

`LoraLinear` wraps any linear (dense `Linear` or `QuantizedLinear`: only its forward is
used, so the delta is applied unmerged on every weight format): y = base(x), then
`kernels.lora_matmul` adds each row's adapters. `LoraEmbedding` wraps `embed_tokens` for
adapters that replace it (modules_to_save). Both read the batch of the forward in flight
from a `LoraState` that the engine sets around `model(...)`; with no batch set (no request
in the step uses an adapter) they are the base layer plus one attribute check, and a layer
no loaded adapter targets is never wrapped.

A modules_to_save replacement W' at scale c is applied as y + c * (x W'^T - y): the
replacement itself at c = 1 (what peft does), the base at 0, in between a blend. It runs
in torch over the rows that use it, so steps that need it run eagerly (not as a graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.lora_matmul import lora_matmul


@dataclass
class LoraSegments:
    """Rows of one forward grouped by request: rows starts[g]:starts[g+1] use scales[g]."""

    starts: torch.Tensor  # [G+1] int32, on the model's device
    scales: torch.Tensor  # [G, S] float32, on the model's device, one column per slot
    max_len: int  # host-side bound on a segment's length
    host_starts: list[int]
    host_scales: torch.Tensor  # [G, S] float32 on the CPU

    def rows_using(self, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows whose segment has slot `slot` active, and the scale of each (CPU)."""
        rows, scales = [], []
        for g, scale in enumerate(self.host_scales[:, slot].tolist()):
            if scale:
                span = range(self.host_starts[g], self.host_starts[g + 1])
                rows.extend(span)
                scales.extend([scale] * len(span))
        if not rows:
            return None
        return torch.tensor(rows), torch.tensor(scales)


@dataclass
class LoraBatch:
    """The LoRA selection of every row of one forward: `body` for the decoder's rows, `head`
    for the rows that reach lm_head (the logits rows)."""

    body: LoraSegments
    head: LoraSegments


class LoraState:
    """The batch of the forward in flight, shared by the engine and every LoRA module."""

    def __init__(self) -> None:
        self.current: LoraBatch | None = None


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, state: LoraState, *, head: bool) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.head = head  # lm_head sees only the logits rows
        self.in_features: int = base.in_features
        self.out_features: int = base.out_features
        self.lora_a: torch.Tensor | None = None  # [L, R, in]
        self.lora_b: torch.Tensor | None = None  # [L, out, R]
        self.slot_map: torch.Tensor | None = None  # [S] int32: slot -> index in a/b, or -1
        self.replacements: dict[int, torch.Tensor] = {}  # slot -> weight [out, in]

    @property
    def empty(self) -> bool:
        return self.lora_a is None and not self.replacements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.current
        if batch is None:
            return y
        seg = batch.head if self.head else batch.body
        x2 = x.reshape(-1, self.in_features)
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
        if self.lora_a is not None:
            lora_matmul(
                y2,
                x2,
                self.lora_a,
                self.lora_b,
                self.slot_map,
                seg.starts,
                seg.scales,
                max_seg_len=seg.max_len,
            )
        return y

    def extra_repr(self) -> str:
        count = 0 if self.lora_a is None else self.lora_a.shape[0]
        return f"loras={count}, replacements={sorted(self.replacements)}"


class LoraEmbedding(nn.Module):
    """embed_tokens with per-request replacement tables (modules_to_save)."""

    def __init__(self, base: nn.Embedding, state: LoraState) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.replacements: dict[int, torch.Tensor] = {}  # slot -> table [vocab, hidden]

    @property
    def weight(self) -> torch.Tensor:
        # Architectures read the table's dtype and device (and Gemma its scale) from here.
        return self.base.weight

    @property
    def empty(self) -> bool:
        return not self.replacements

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        out = self.base(token_ids)
        batch = self.state.current
        if batch is None:
            return out
        for slot, table in self.replacements.items():
            found = batch.body.rows_using(slot)
            if found is not None:
                rows, scale = (t.to(out.device) for t in found)
                own = table[token_ids[rows]]
                out[rows] = out[rows] + scale[:, None].to(out.dtype) * (own - out[rows])
        return out
