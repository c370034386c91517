"""Which row-parallel sums run inside the next norm, and the norm that runs them.

In `DecoderLayer.forward_residual` (engine/modules.py), the path of every decoder layer
while fused kernels are on, the attention's output (o_proj's sum) goes straight into
`post_attention_layernorm.forward_add`, and the MLP's (down_proj's) into the next
layer's `input_layernorm.forward_add`. There the site all-reduce's fused kernel does the
sum, its cast, the residual add and the norm in one launch (site_reduce.py). Only layers
whose code is exactly that (the class's forward_residual, Attention's and the gated MLPs'
forward) defer their sums; the last layer's down_proj does not (the head gathers rows of
its input first), nor does any other layer's, so that every other consumer gets a summed
tensor (`SiteAllReduce.sum`: all-reduce + cast, one kernel). Single-GPU code is unchanged:
only the sharded model's norms are replaced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from engine.modules import Attention, DecoderLayer, FusedGatedMLP, GatedMLP, RMSNorm
from engine.tensor_parallel.site_reduce import SiteAllReduce


class SiteLinear(Protocol):
    """What wire_sites sets on a row-parallel linear (transform.AllReduceLinear)."""

    sites: SiteAllReduce | None
    prompt_sites: SiteAllReduce | None
    site: int
    defer_sum: bool


class ReducingRMSNorm(RMSNorm):
    """An RMSNorm whose residual add may receive a deferred site partial, a decode row's
    (`sites`) or a prompt row's (`prompt_sites`, the half-precision prompt slices, where
    they exist): then the sum over the ranks, the add and the norm are one kernel; anything
    else goes to RMSNorm's."""

    def __init__(
        self, norm: RMSNorm, sites: SiteAllReduce, prompt_sites: SiteAllReduce | None
    ) -> None:
        super().__init__(norm.weight.shape[0], norm.eps, unit_offset=norm.unit_offset)
        self.weight = norm.weight
        self.sites = sites
        self.prompt_sites = prompt_sites

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for sites in (self.sites, self.prompt_sites):
            if sites is None:
                continue
            site = sites.take(x)
            if site is not None:
                return sites.add_rms_norm(
                    site, residual, self.weight, self.eps, unit_offset=self.unit_offset
                )
            if sites.pending:
                # The deferred partial is not the tensor this norm got (something between
                # them made a new one): adding x would add this rank's part alone.
                raise RuntimeError(
                    "tensor parallel: a deferred row-parallel partial did not reach its norm "
                    "(the layer changed its output on the way)"
                )
        return super().forward_add(x, residual)


def _known_layer(layer: nn.Module) -> bool:
    """Whether `layer` runs DecoderLayer.forward_residual over the stock attention and
    gated MLP, so that each row-parallel output reaches the norm named in the docstring."""
    if getattr(type(layer), "forward_residual", None) is not DecoderLayer.forward_residual:
        return False
    assert isinstance(layer, DecoderLayer)
    mlp = getattr(layer, layer.mlp_name, None)
    return (
        type(layer.self_attn).forward is Attention.forward
        and isinstance(mlp, (GatedMLP, FusedGatedMLP))
        and type(mlp).forward in (GatedMLP.forward, FusedGatedMLP.forward)
        and type(layer.input_layernorm) is RMSNorm
        and type(layer.post_attention_layernorm) is RMSNorm
    )


def wire_sites(
    layers: nn.ModuleList,
    linears: Sequence[SiteLinear],
    sites: SiteAllReduce,
    prompt_sites: SiteAllReduce | None = None,
) -> int:
    """Give each row-parallel linear its site (in `linears`' order, the same on every rank),
    the site all-reduce and the prompt slices (None: prompt rows take NCCL); defer the sums
    that go straight into a norm and replace those norms. Returns how many sums are
    deferred."""
    for index, linear in enumerate(linears):
        linear.sites, linear.site, linear.defer_sum = sites, index, False
        linear.prompt_sites = prompt_sites

    def reducing(norm: nn.Module) -> ReducingRMSNorm:
        assert isinstance(norm, RMSNorm)  # _known_layer checked it
        return ReducingRMSNorm(norm, sites, prompt_sites)

    ours = {id(linear): linear for linear in linears}
    decoders = [layer if _known_layer(layer) else None for layer in layers]
    deferred = 0
    for i, layer in enumerate(decoders):
        if not isinstance(layer, DecoderLayer):
            continue
        o_proj = ours.get(id(layer.self_attn.o_proj))
        if o_proj is not None:
            o_proj.defer_sum = True
            layer.post_attention_layernorm = reducing(layer.post_attention_layernorm)
            deferred += 1
        down = ours.get(id(getattr(layer, layer.mlp_name).down_proj))
        following = decoders[i + 1] if i + 1 < len(decoders) else None
        if down is not None and isinstance(following, DecoderLayer):
            down.defer_sum = True
            following.input_layernorm = reducing(following.input_layernorm)
            deferred += 1
    return deferred
