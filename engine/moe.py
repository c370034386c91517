"""Sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE), as transformers computes it.

Routing: router logits = gate(x) [T, E]; probabilities = softmax over all E experts in
float32; the top-k experts of each row are kept, and their weights renormalized to sum to 1
when `norm_topk_prob` (always for Mixtral, where that equals a softmax over the top-k
logits). Each expert is a gated MLP; a row's output is the weighted sum of its k experts.
Experts run one after another over the rows routed to them (transformers' eager loop, in
the same order, so sums round alike).

Two checkpoint layouts load (the architecture picks one from the checkpoint's tensor names):

- per expert, `experts.<e>.<gate>/<up>/<down>.weight` (`w1`/`w3`/`w2` for Mixtral,
  `gate_proj`/`up_proj`/`down_proj` for Qwen): what the Hub holds, what `save_pretrained`
  writes by default in transformers 4 and 5, and what EXL2/GPTQ quantize per linear;
- fused, `experts.gate_up_proj` [E, 2I, H] (gate rows first) and `experts.down_proj`
  [E, H, I]: transformers 5's in-memory layout, written by `save_pretrained(...,
  save_original_format=False)`. Dense weights only.

Router dtype quirk: Mixtral multiplies expert outputs by float32 routing weights; Qwen casts
the weights to the activation dtype first (`weights_in_activation_dtype`). Only half
precision sees the difference.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora.batch import LoraBatch
from engine.modules import ACTIVATIONS, FusesKernels, Linear, gated_activation

# Mixtral's expert names: w1 gate, w3 up, w2 down.
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


class ExpertMLP(FusesKernels):
    """down(act(gate(x)) * up(x)) under the checkpoint's own linear names. Fused kernels:
    SiLU and the product as one kernel (gated_activation)."""

    def __init__(
        self, hidden: int, intermediate: int, act: str, names: tuple[str, str, str]
    ) -> None:
        super().__init__()
        self.act_name = act
        self.names = names
        gate, up, down = names
        setattr(self, gate, Linear(hidden, intermediate))
        setattr(self, up, Linear(hidden, intermediate))
        setattr(self, down, Linear(intermediate, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        out: torch.Tensor = down(
            gated_activation(self.act_name, gate(x), up(x), fused=self.fuse_kernels)
        )
        return out


class FusedExperts(FusesKernels):
    """All experts' weights in two 3-D tensors (transformers 5's layout). Fused kernels:
    SiLU and the product as one kernel (gated_activation)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.act_name = act
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, intermediate), requires_grad=False
        )

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        hidden = gated_activation(self.act_name, gate, up, fused=self.fuse_kernels)
        return F.linear(hidden, self.down_proj[e])


class SparseMoE(nn.Module):
    """Top-k routed experts: `gate` (the router, [E, H]) and `experts`."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        act: str,
        *,
        norm_topk_prob: bool,
        expert_names: tuple[str, str, str],
        fused: bool = False,
        weights_in_activation_dtype: bool = False,
    ) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"activation '{act}' is not supported ({', '.join(ACTIVATIONS)})")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weights_in_activation_dtype = weights_in_activation_dtype
        self.gate = Linear(hidden, num_experts)
        self.experts: FusedExperts | nn.ModuleList
        if fused:
            self.experts = FusedExperts(num_experts, hidden, intermediate, act)
        else:
            self.experts = nn.ModuleList(
                ExpertMLP(hidden, intermediate, act, expert_names) for _ in range(num_experts)
            )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights [T, k] and expert ids [T, k] of each row."""
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_activation_dtype:
            weights = weights.to(logits.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """`lora` is not applied: experts see routed rows, not a request's (engine/lora
        targets no linear in here)."""
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        # [E, T, k] one-hot; the host loop visits only experts some row was routed to.
        mask = F.one_hot(experts, self.num_experts).permute(2, 0, 1)
        for e in mask.flatten(1).any(dim=1).nonzero().flatten().tolist():
            rows, slot = torch.where(mask[e])
            if isinstance(self.experts, FusedExperts):
                y = self.experts.expert(e, x[rows])
            else:
                y = self.experts[e](x[rows])
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        return out


def has_fused_experts(tensor_names: Collection[str]) -> bool:
    """Whether a checkpoint stores its experts fused (`....experts.gate_up_proj`)."""
    return any(name.endswith(".experts.gate_up_proj") for name in tensor_names)
