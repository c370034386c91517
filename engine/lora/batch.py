"""The LoRA selection of one forward's rows, as the LoRA modules read it.

A `LoraBatch` travels in the forward's `ForwardBatch.lora` (None: no row of the step uses
an adapter) and every projection is called with it (engine/modules.py); the model runner
builds it per step (`LoraManager.batch`), a LoRA decode graph keeps a static one
(`LoraManager.static_batch`). Plain data over tensors: no module state, no side channel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoraSegments:
    """Rows of one forward grouped by request: rows starts[g]:starts[g+1] use scales[g]."""

    starts: torch.Tensor  # [G+1] int32, on the model's device
    scales: torch.Tensor  # [G, S] float32, on the model's device, one column per slot
    max_len: int  # host-side bound on a segment's length
    host_starts: list[int]
    host_scales: torch.Tensor  # [G, S] float32 on the CPU
    _copies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`starts` and `scales` on `device`: a layer-split model's layers sit on several
        GPUs and the kernels read these from their own (copied once per device, per step)."""
        if self.starts.device == device:
            return self.starts, self.scales
        if device not in self._copies:
            self._copies[device] = (self.starts.to(device), self.scales.to(device))
        return self._copies[device]

    def rows_using(self, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows whose segment has slot `slot` active, and the scale of each (CPU)."""
        rows: list[int] = []
        scales: list[float] = []
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
