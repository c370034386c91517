"""Building blocks of decoder-only transformers, shared by the architecture files.

Module attribute names mirror the checkpoint's tensor names (`self_attn.q_proj`,
`mlp.gate_proj`, `input_layernorm`, ...), so a parameter's qualified name is the tensor's
name in the safetensors file and loading needs no mapping table.

Every forward works on flat token rows: hidden states are [T, hidden] for the T new tokens
of all sequences in a `ForwardBatch`; the batch says where each sequence's rows are.

Projections that read one input may be built as one linear (`Attention(fuse_qkv=True)`,
`GatedMLP(fuse_gate_up=True)`, as engine/build_plan.py decides): such a module names the
checkpoint's parts in `load_sources`, and the loader concatenates them into it.

LoRA: every projection is called as `linear(x, lora)` with the forward's `LoraBatch`
(`ForwardBatch.lora`, None when no row of the step uses an adapter). A plain linear
ignores it; engine/lora's wrappers apply each row's adapters from it.

Fused kernels (`fuse_kernels`, on by default; modules that have them are `FusesKernels`,
built on or off by the build plan): a decoder layer's residual adds run inside the next
RMSNorm (`DecoderLayer.forward_residual`, driven by `CausalLM.forward`), a gated MLP's SiLU
and product are one kernel (at decode, the last kernel of a quantized gate_up projection),
and RoPE writes k and v straight into a native KV cache. Each fused op rounds where the
separate ops round, so outputs are the same; at batch 1 they save ~5 launches a layer (6 on
a quantized decode). At quantized decode the norms also fold into the GEMVs' slot sums
(engine/norm_fold.py), which is as accurate and reproducible but not the same bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.cache import ForwardBatch, PagedKVCache
from engine.lora.batch import LoraBatch
from engine.norm_fold import (
    FoldedHidden,
    folded_weight,
    input_row_order,
    linears_fold,
    norm_folds,
    plain_quantized,
    projection_rotates,
)
from kernels.attention import paged_attention, prompt_attention, prompt_attention_applies
from kernels.quant_matmul.norm_fold import (
    quant_matmul_normed,
    quant_matmul_normed_rope,
    quant_matmul_residual,
)
from kernels.quant_matmul.qkv_rope import quant_matmul_rope
from kernels.quant_matmul.slot_sum_rope import RopeCacheWrite

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def gated_activation(
    act: str, gate: torch.Tensor, up: torch.Tensor, *, fused: bool
) -> torch.Tensor:
    """ACTIVATIONS[act](gate) * up; SiLU as one kernel (`kernels.silu_mul`) when `fused`."""
    if fused and act == "silu":
        return kernels.silu_mul(gate, up)
    return ACTIVATIONS[act](gate) * up


def gate_up_activation(
    gate_up: nn.Module, x: torch.Tensor, lora: LoraBatch | None, act: str, *, fused: bool
) -> torch.Tensor:
    """ACTIVATIONS[act](gate) * up of a linear whose output is [gate | up], as
    `gated_activation` of its halves. With fused SiLU, a linear that has
    `forward_silu_mul(x, lora)` (a quantized linear, LoRA's wrapper of one) takes the product
    into its own last kernel: on the decode GEMV the slot sum writes silu(gate) * up, one
    launch and the [T, 2I] intermediate fewer (issue 31). Same bits either way. A linear with
    forward hooks is called as such (the hooks expect its own output)."""
    if fused and act == "silu":
        fold = getattr(gate_up, "forward_silu_mul", None)
        if fold is not None and not (gate_up._forward_hooks or gate_up._forward_pre_hooks):
            out: torch.Tensor = fold(x, lora)
            return out
    gate, up = gate_up(x, lora).chunk(2, dim=-1)
    return gated_activation(act, gate, up, fused=fused)


class FusesKernels(nn.Module):
    """A module with fused small-op kernels, on while `fuse_kernels` (same results either
    way, except the decode norm fold's last bits, engine/norm_fold.py; launches differ).
    `CausalLM` sets it in every such module from its build plan (engine/build_plan.py);
    tools and tests may switch it (engine.fusion.set_kernel_fusion)."""

    def __init__(self) -> None:
        super().__init__()
        self.fuse_kernels = True


class Linear(nn.Module):
    """A dense FP16/BF16/FP32 linear layer; y = x W^T + b with W [out, in] as HF stores it.

    Quantized formats replace this module at load time with one of the same interface
    (`in_features`, `out_features`, `forward(x, lora)`). `lora` is for LoRA's wrappers
    (engine/lora), which take a linear's place: a plain linear has no adapters."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """The token embeddings; `lora` as for `Linear` (LoraEmbedding takes its place)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.weight.requires_grad_(False)

    def reset_parameters(self) -> None:
        # The table always comes from the checkpoint: nn.Embedding's random init is wasted
        # work, and on the meta device the model is built on it imports torch._dynamo
        # (~4 s on a process's first load).
        pass

    def forward(self, token_ids: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        return super().forward(token_ids)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset  # Gemma stores w - 1 and multiplies by (1 + w)
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), the sum rounded to the dtype first: one launch."""
        return kernels.add_rms_norm(
            x, residual, self.weight, self.eps, unit_offset=self.unit_offset
        )


@dataclass
class Rotary:
    """cos/sin tables [max_pos, R/2] (float32) on one device."""

    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class AttentionSpec:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    scale: float | None = None  # default head_dim ** -0.5
    sliding_window: int | None = None
    softcap: float | None = None
    # One `qkv_proj` whose output is [q | k | v] (Phi-3) instead of q_proj/k_proj/v_proj.
    fused_qkv: bool = False
    # Per-head RMSNorm of q and k before RoPE (`q_norm`, `k_norm` over head_dim: Qwen3, Gemma 3).
    qk_norm: bool = False
    norm_eps: float = 1e-6
    norm_unit_offset: bool = False  # Gemma's (1 + w) norms


class Attention(FusesKernels):
    """Fused kernels: RoPE and the K/V write as one kernel where the cache stores the
    model's dtype. `fuse_qkv`: q/k/v stored apart are built as one `qkv_proj` (see
    engine/build_plan.py), loaded from the three (`load_sources`)."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    qkv_proj: nn.Module

    def __init__(
        self,
        spec: AttentionSpec,
        layer_idx: int,
        *,
        fuse_qkv: bool = False,
    ) -> None:
        super().__init__()
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        # Fused linears the checkpoint stores as parts: {fused leaf: (part leaf, width)...}.
        self.load_sources: dict[str, tuple[tuple[str, int], ...]] = {}
        if fuse_qkv and not spec.fused_qkv:
            spec = dataclasses.replace(spec, fused_qkv=True)
            self.load_sources["qkv_proj"] = (
                ("q_proj", q_size),
                ("k_proj", kv_size),
                ("v_proj", kv_size),
            )
        self.spec = spec
        self.layer_idx = layer_idx
        s = spec
        if s.fused_qkv:
            # Kept fused (not split at load) so a quantized qkv_proj loads as one linear.
            self.qkv_proj = Linear(s.hidden_size, q_size + 2 * kv_size, s.qkv_bias)
        else:
            self.q_proj = Linear(s.hidden_size, q_size, s.qkv_bias)
            self.k_proj = Linear(s.hidden_size, kv_size, s.qkv_bias)
            self.v_proj = Linear(s.hidden_size, kv_size, s.qkv_bias)
        self.o_proj: nn.Module = Linear(q_size, s.hidden_size, s.o_bias)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.norm_eps, unit_offset=s.norm_unit_offset)
            self.k_norm = RMSNorm(s.head_dim, s.norm_eps, unit_offset=s.norm_unit_offset)
        self.scale = s.scale if s.scale is not None else s.head_dim**-0.5

    def project(
        self, x: torch.Tensor, lora: LoraBatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hk, D] of the new rows (views into a fused output)."""
        s = self.spec
        num_tokens = x.shape[0]
        if s.fused_qkv:
            return self.split_qkv(self.qkv_proj(x, lora))
        else:
            q, k, v = self.q_proj(x, lora), self.k_proj(x, lora), self.v_proj(x, lora)
        return (
            q.view(num_tokens, s.num_heads, s.head_dim),
            k.view(num_tokens, s.num_kv_heads, s.head_dim),
            v.view(num_tokens, s.num_kv_heads, s.head_dim),
        )

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache, rotary: Rotary
    ) -> torch.Tensor:
        out: torch.Tensor = self.o_proj(self.attend_rows(x, batch, cache, rotary), batch.lora)
        return out

    def attend_rows(
        self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache, rotary: Rotary
    ) -> torch.Tensor:
        """The attention of the rows x, before o_proj: [T, Hq * D]. Where the qkv GEMV's slot
        sum can rotate q and k and write the cache (`project_rotated`), it does."""
        q_rotated = self.project_rotated(x, batch, cache, rotary)
        if q_rotated is not None:
            return self.attend_cached(q_rotated, batch, cache)
        return self.attend(*self.project(x, batch.lora), batch, cache, rotary)

    def project_rotated(
        self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache, rotary: Rotary
    ) -> torch.Tensor | None:
        """q [T, Hq, D] rotated, k and v rotated and written into the cache, by the qkv
        GEMV's slot sum (kernels/quant_matmul/qkv_rope.py: one launch fewer than the
        projection and apply_rope_write), where that applies: a decode step without LoRA,
        a plain quantized fused qkv_proj (engine.norm_fold.projection_rotates) and a cache
        write that fuses (rope_cache_write). None: project and attend as usual."""
        s = self.spec
        if batch.lora is not None or not s.fused_qkv:
            return None
        # The weight first: on the CPU and for prompts it refuses before any set-up.
        width = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        weight = projection_rotates(x, self.qkv_proj, width)
        if weight is None:
            return None
        rope = self.rope_cache_write(batch, cache, rotary, x.dtype)
        if rope is None:
            return None
        return quant_matmul_rope(x, weight, rope)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v views of a fused qkv_proj's output [T, (Hq + 2 Hk) D]."""
        s = self.spec
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        num_tokens = qkv.shape[0]
        return (
            q.view(num_tokens, s.num_heads, s.head_dim),
            k.view(num_tokens, s.num_kv_heads, s.head_dim),
            v.view(num_tokens, s.num_kv_heads, s.head_dim),
        )

    def rope_write_fuses(self, cache: PagedKVCache, dtype: torch.dtype) -> bool:
        """Whether RoPE and the cache write are one kernel (kernels.apply_rope_write): a
        native cache of the activations' dtype (quantized caches quantize on write)."""
        k_cache = cache.k_slots[self.layer_idx]
        quantized = cache.k_format.quantized or cache.v_format.quantized
        return self.fuse_kernels and not quantized and k_cache.dtype == dtype

    def rope_cache_write(
        self, batch: ForwardBatch, cache: PagedKVCache, rotary: Rotary, dtype: torch.dtype
    ) -> RopeCacheWrite | None:
        """Where the qkv projection's slot sum can rotate q and k and write k and v itself
        (kernels/quant_matmul/slot_sum_rope.py), for the folded decode path: as
        `rope_write_fuses` for activations of `dtype`, with no q/k norm between the
        projection and the rotation."""
        s = self.spec
        if s.qk_norm or not self.rope_write_fuses(cache, dtype):
            return None
        return RopeCacheWrite(
            batch.positions,
            batch.slots,
            rotary.cos,
            rotary.sin,
            cache.k_slots[self.layer_idx],
            cache.v_slots[self.layer_idx],
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
        )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        rotary: Rotary,
    ) -> torch.Tensor:
        """The attention of the projected rows, before o_proj: [T, Hq * D]."""
        s = self.spec
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # The flat slots, with the scratch slot that graph padding rows write (engine.cache).
        k_cache, v_cache = cache.k_slots[self.layer_idx], cache.v_slots[self.layer_idx]
        if self.rope_write_fuses(cache, k.dtype):
            q = kernels.apply_rope_write(
                q, k, v, batch.positions, rotary.cos, rotary.sin, k_cache, v_cache, batch.slots
            )
            return self.attend_cached(q, batch, cache, v=v)
        # Quantized caches quantize on write (kernels.kv_quant): rotate, then write.
        q, k = kernels.apply_rope(q, k, batch.positions, rotary.cos, rotary.sin)
        cache.write(self.layer_idx, batch.slots, k, v)
        return self.attend_cached(q, batch, cache, k, v)

    def attend_cached(
        self,
        q: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention of the rotated q [T, Hq, D] whose rows' k and v are in the cache
        already, before o_proj: [T, Hq * D]. A fresh prompt's attention reads the rows' own
        k and v: those given (k rotated), the others read back from a native cache's slots."""
        s = self.spec
        num_tokens = q.shape[0]
        quantized = cache.k_format.quantized or cache.v_format.quantized
        if batch.fresh and prompt_attention_applies(
            q,
            quantized_cache=quantized,
            sliding_window=s.sliding_window,
            softcap=s.softcap,
        ):
            # What went straight into the cache (rotated keys, values) is read back.
            if k is None:
                k = cache.k_slots[self.layer_idx].index_select(0, batch.slots)
            if v is None:
                v = cache.v_slots[self.layer_idx].index_select(0, batch.slots)
            out = prompt_attention(q, k, v, scale=self.scale)
            return out.view(num_tokens, s.num_heads * s.head_dim)
        out = paged_attention(
            q,
            cache.k[self.layer_idx],
            cache.v[self.layer_idx],
            batch.cu_seqlens,
            batch.context_lens,
            batch.page_table,
            scale=self.scale,
            sliding_window=s.sliding_window,
            softcap=s.softcap,
            max_query_len=batch.max_query_len,
            max_context_len=batch.max_context_len,
            k_format=cache.k_format,
            v_format=cache.v_format,
        )
        return out.view(num_tokens, s.num_heads * s.head_dim)


class GatedMLP(FusesKernels):
    """down(act(gate(x)) * up(x)): SwiGLU for Llama, GeGLU for Gemma.

    `fuse_gate_up`: gate and up stored apart are built as one `gate_up_proj` (output
    [gate | up]; see engine/build_plan.py), loaded from the two (`load_sources`). Fused
    kernels: SiLU and the product as one kernel (gated_activation), or inside the fused
    projection's own kernel (gate_up_activation)."""

    gate_proj: nn.Module
    up_proj: nn.Module

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str,
        bias: bool = False,
        *,
        fuse_gate_up: bool = False,
    ) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"activation '{act}' is not supported ({', '.join(ACTIVATIONS)})")
        self.act_name = act
        self.load_sources: dict[str, tuple[tuple[str, int], ...]] = {}
        self.gate_up_proj: nn.Module | None = None
        if fuse_gate_up:
            self.gate_up_proj = Linear(hidden, 2 * intermediate, bias)
            self.load_sources["gate_up_proj"] = (
                ("gate_proj", intermediate),
                ("up_proj", intermediate),
            )
        else:
            self.gate_proj = Linear(hidden, intermediate, bias)
            self.up_proj = Linear(hidden, intermediate, bias)
        self.down_proj: nn.Module = Linear(intermediate, hidden, bias)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        if self.gate_up_proj is not None:
            hidden = gate_up_activation(
                self.gate_up_proj, x, lora, self.act_name, fused=self.fuse_kernels
            )
        else:
            gate, up = self.gate_proj(x, lora), self.up_proj(x, lora)
            hidden = gated_activation(self.act_name, gate, up, fused=self.fuse_kernels)
        out: torch.Tensor = self.down_proj(hidden, lora)
        return out


class FusedGatedMLP(FusesKernels):
    """GatedMLP with gate and up in one `gate_up_proj` whose output is [gate | up], as the
    checkpoint stores it (Phi-3)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"activation '{act}' is not supported ({', '.join(ACTIVATIONS)})")
        self.act_name = act
        self.gate_up_proj: nn.Module = Linear(hidden, 2 * intermediate, bias)
        self.down_proj: nn.Module = Linear(intermediate, hidden, bias)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        hidden = gate_up_activation(
            self.gate_up_proj, x, lora, self.act_name, fused=self.fuse_kernels
        )
        out: torch.Tensor = self.down_proj(hidden, lora)
        return out


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h += attn(norm(h)); h += mlp(norm(h)).

    `mlp_name` is the feed-forward's checkpoint name (`mlp`; Mixtral's `block_sparse_moe`)."""

    def __init__(
        self, attn: Attention, mlp: nn.Module, hidden: int, eps: float, *, mlp_name: str = "mlp"
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)

    def forward(
        self, h: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache, rotary: Rotary
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), batch, cache, rotary)
        feed_forward = getattr(self, self.mlp_name)
        mlp: torch.Tensor = feed_forward(self.post_attention_layernorm(h), batch.lora)
        return h + mlp

    def forward_residual(
        self,
        x: torch.Tensor | FoldedHidden,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        cache: PagedKVCache,
        rotary: Rotary,
        next_norm: nn.Module | None = None,
        next_qkv: nn.Module | None = None,
    ) -> tuple[torch.Tensor | FoldedHidden, torch.Tensor | None]:
        """`forward` with every residual add inside the following norm's kernel.

        The hidden state is carried as (x, residual) with h = residual + x still to be
        added (residual None: h = x). Returns (mlp output, residual): the last add is left
        to the next layer's input norm, or the final norm (`CausalLM.forward`). Where the
        norms fold into the GEMVs (engine/norm_fold.py) x is a FoldedHidden, and
        `next_norm` (the next layer's input norm, on this device) is the one whose weight
        down_proj's slot sum applies for it, in the row order of `next_qkv` (the next
        layer's qkv projection) where that is a plain quantized linear.
        """
        folded = self._folded(x, batch)
        if folded is not None:
            return folded(x, residual, batch, cache, rotary, next_norm, next_qkv)
        if isinstance(x, FoldedHidden):  # the previous layer folded, this one does not
            x = x.h
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm.forward_add(x, residual)
        attn = self.self_attn(normed, batch, cache, rotary)
        normed, residual = self.post_attention_layernorm.forward_add(attn, residual)
        return getattr(self, self.mlp_name)(normed, batch.lora), residual

    def _folded(
        self, x: torch.Tensor | FoldedHidden, batch: ForwardBatch
    ) -> Callable[..., tuple[torch.Tensor | FoldedHidden, torch.Tensor | None]] | None:
        """`_forward_folded` where this layer's norms fold into its GEMVs (engine/norm_fold.py:
        the plain quantized decode case), else None."""
        h = x.h if isinstance(x, FoldedHidden) else x
        attn, mlp = self.self_attn, getattr(self, self.mlp_name)
        if batch.lora is not None or type(attn) is not Attention or not attn.spec.fused_qkv:
            return None
        if type(mlp) not in (GatedMLP, FusedGatedMLP) or mlp.gate_up_proj is None:
            return None
        if not (attn.fuse_kernels and mlp.fuse_kernels):
            return None
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if any(type(n) is not RMSNorm or not norm_folds(n, h) for n in norms):
            return None
        if not linears_fold(
            h, normed=(attn.qkv_proj, mlp.gate_up_proj), residual=(attn.o_proj, mlp.down_proj)
        ):
            return None
        return self._forward_folded

    def _forward_folded(
        self,
        x: torch.Tensor | FoldedHidden,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        cache: PagedKVCache,
        rotary: Rotary,
        next_norm: nn.Module | None,
        next_qkv: nn.Module | None = None,
    ) -> tuple[FoldedHidden, None]:
        """`forward_residual` with both norms inside the GEMVs: o_proj's and down_proj's
        slot sums add the residual and write the sums of squares and h * w for the next
        norm, qkv's and gate_up's slot sums apply the rstd (kernels/quant_matmul/
        norm_fold.py), and qkv's also RoPE and the native cache write where the attention
        allows (Attention.rope_cache_write, kernels/quant_matmul/slot_sum_rope.py). A layer
        after the embedding, or after a layer that did not fold or did not know this
        layer's norm, runs its input norm as a kernel first."""
        attn, mlp = self.self_attn, getattr(self, self.mlp_name)
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        qkv_weight = folded_weight(attn.qkv_proj)
        xw_in = x.xw_for(qkv_weight) if isinstance(x, FoldedHidden) else None
        if isinstance(x, FoldedHidden) and xw_in is not None and x.norm is norm_in:
            h = x.h
            qkv_x, in_order = xw_in
            rope = attn.rope_cache_write(batch, cache, rotary, h.dtype)
            if rope is not None:
                # RoPE and the cache write in qkv's slot sum too: q comes back rotated.
                q = quant_matmul_normed_rope(
                    qkv_x, x.squares, norm_in.eps, qkv_weight, h.dtype, rope,
                    x_in_row_order=in_order,
                )  # fmt: skip
                out = attn.attend_cached(q, batch, cache)
            else:
                qkv = quant_matmul_normed(
                    qkv_x, x.squares, norm_in.eps, qkv_weight, h.dtype, x_in_row_order=in_order
                )
                out = attn.attend(*attn.split_qkv(qkv), batch, cache, rotary)
        else:
            if isinstance(x, FoldedHidden):  # h, the residual already added
                x, residual = x.h, None
            if residual is None:
                normed, h = norm_in(x), x
            else:
                normed, h = norm_in.forward_add(x, residual)
            out = attn.attend_rows(normed, batch, cache, rotary)
        gate_up, down = folded_weight(mlp.gate_up_proj), folded_weight(mlp.down_proj)
        silu = mlp.act_name == "silu"
        # gate_up's input, and down's where gate_up's slot sum makes it (silu), are stored
        # in those weights' row order: their GEMVs then gather nothing (input_row_order).
        gate_up_order = input_row_order(gate_up)
        down_order = input_row_order(down) if silu else None
        h, squares, xw = quant_matmul_residual(
            out, folded_weight(attn.o_proj), h.contiguous(), norm_post.weight,
            unit_offset=norm_post.unit_offset, xw_scatter=gate_up_order,
        )  # fmt: skip
        assert xw is not None  # a norm weight was given
        hidden = quant_matmul_normed(
            xw, squares, norm_post.eps, gate_up, h.dtype, silu_mul=silu,
            x_in_row_order=gate_up_order is not None, scatter=down_order,
        )  # fmt: skip
        if not silu:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = gated_activation(mlp.act_name, gate, up, fused=True)
        # The next layer's input norm, when it can read h * w (else it runs as a kernel).
        nxt = next_norm if type(next_norm) is RMSNorm and norm_folds(next_norm, h) else None
        # In the next qkv's row order where it is a plain quantized linear (it checks).
        next_base = plain_quantized(next_qkv) if nxt is not None else None
        qkv_order = input_row_order(next_base.qweight) if next_base is not None else None
        h, squares, xw = quant_matmul_residual(
            hidden, down, h, nxt.weight if nxt is not None else None,
            unit_offset=nxt is not None and nxt.unit_offset,
            x_in_row_order=down_order is not None, xw_scatter=qkv_order,
        )  # fmt: skip
        xw_perm = None
        if qkv_order is not None and next_base is not None:  # (qkv_order implies next_base)
            xw_perm = next_base.qweight.perm
        return FoldedHidden(h, squares, xw, nxt, xw_perm), None
