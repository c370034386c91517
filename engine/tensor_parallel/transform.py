"""Turn a loaded model into one rank's tensor-parallel shard (Megatron-style).

Per decoder layer, two all-reduces and nothing else crosses ranks (per forward, one more for
the embedding rows and an all-gather of the logits: vocab.py):

- attention: q/k/v (or a fused qkv_proj) are column-parallel by heads: rank r keeps KV
  heads [r*Hk/W, (r+1)*Hk/W) and the query heads that read them; attention runs on the
  local heads over the local KV cache (which holds only those KV heads); o_proj is
  row-parallel over the same query-head inputs and its partial outputs are summed;
- MLP: gate/up (or gate_up_proj) are column-parallel and down_proj row-parallel over the
  same intermediate columns, then summed. For a quantized down_proj the rank takes whole
  quantization groups, so that its shard keeps the kernels' per-group path (split_k.py's
  chunks_in_groups); gate/up then take exactly the intermediate columns those rows read.
  GPTQ: an even contiguous block of groups. Without act-order that is a contiguous block
  of intermediate columns, so each rank reads only its half of each gate/up row and its
  block of down_proj's rows (issue 33: with round-robin groups, 128-column runs, every
  rank read whole gate/up rows, 30.8 of a 70B model's 37 GB to keep 19). With act-order
  (g_idx) a group's columns are scattered whichever groups a rank takes; a contiguous
  column block would split every group instead. EXL2: round-robin (group g on rank
  g % W): q_perm scatters a group's columns anyway, and its bit widths fall group by group
  (non-increasing), so contiguous blocks would give the first rank the widest codes.

The embeddings and the head are cut by vocabulary rows (vocab.py: the embedding rows are
summed, the logits gathered, so every rank ends with the whole vocabulary's logits; rank
0's are the ones used); the norms are replicated (hidden_size values each). The layers
never learn the world size: their spec is replaced by the local one and the row-parallel
linears are wrapped in `AllReduceLinear`. Mixture-of-experts feed-forwards are not
sharded (refused clearly).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from engine.architectures.base import CausalLM
from engine.linears import linear_features
from engine.lora.batch import LoraBatch
from engine.modules import Attention, FusedGatedMLP, FusesKernels, GatedMLP, Linear
from engine.quantized_linear import QuantizedLinear
from engine.tensor_parallel.all_reduce import GroupAllReduce
from engine.tensor_parallel.errors import TensorParallelError
from engine.tensor_parallel.fused_sites import wire_sites
from engine.tensor_parallel.shard import (
    rows_of_inputs,
    shard_columns,
    shard_rows_dense,
    shard_rows_quantized,
)
from engine.tensor_parallel.site_reduce import PROMPT_SLOTS, SiteAllReduce, fused_enabled
from engine.tensor_parallel.vocab import LoadedVocab, VocabParallelEmbedding, shard_vocab
from kernels.quant_matmul import quant_matmul

log = logging.getLogger(__name__)

# Up to this many rows (decode batches), quantized partial products are summed in float32
# and rounded to the activation dtype once, as a single GPU rounds its float32 accumulator:
# TP decode then matches one GPU up to summation order. The kernels take float32
# activations at the same speed there (memory-bound); larger M (prefill) sums in fp16.
FLOAT32_REDUCE_MAX_ROWS = 64


class AllReduceLinear(FusesKernels):
    """A row-parallel linear: each rank's partial product, summed over the group (by NCCL or
    gloo until `use_all_reduce` gives it the rank's GroupAllReduce).

    Decode rows on a GPU with symmetric memory go to the site all-reduce (site_reduce.py,
    set by fused_sites.use_site_all_reduce): the sum and its cast in one kernel, or, where
    `defer_sum` is set and fused kernels are on, the partial handed to the next norm,
    which sums, adds and normalizes in one kernel. Prompt rows there go to the prompt
    slices (`prompt_sites`, SiteAllReduce.build_prompt) in the activation dtype."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        self.reduce: GroupAllReduce | None = None
        self.in_features, self.out_features = linear_features(inner)
        self.sites: SiteAllReduce | None = None
        self.site = -1
        self.defer_sum = False
        self.prompt_sites: SiteAllReduce | None = None

    def _sum(self, y: torch.Tensor) -> torch.Tensor:
        if self.reduce is not None:
            return self.reduce(y)
        dist.all_reduce(y, group=self.group)
        return y

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """`lora`: as every linear takes it (engine/modules.py); LoRA under tensor
        parallelism is refused (engine/tensor_parallel/runner.py), so it is None here."""
        inner = self.inner
        if (
            isinstance(inner, QuantizedLinear)
            and x.dtype != torch.float32
            and x.shape[0] <= FLOAT32_REDUCE_MAX_ROWS
        ):
            shape = (*x.shape[:-1], inner.out_features)
            sites = self.sites  # set on GPUs with symmetric memory (and in CPU tests)
            staged = sites.staging(self.site, shape) if sites is not None else None
            if staged is not None and sites is not None:
                if x.is_cuda:
                    quant_matmul(x, inner.qweight, out=staged)
                else:  # the tests' ranks simulated on the CPU (float32 weight copy)
                    staged.copy_(inner(x.float()))
                if self.defer_sum and self.fuse_kernels:
                    return sites.defer(self.site, staged)
                return sites.sum(self.site, staged, x.dtype)
            if x.is_cuda and inner.out_features == inner.qweight.out_features:
                # The kernels sum in float32 whatever x's dtype: they write the partial as
                # float32 straight into the one-shot all-reduce's buffer when it takes the
                # message (else a new tensor), with no cast of x and no copy: two kernels
                # fewer per row-parallel linear (64 per token for an 8B model).
                staged = self.reduce.staging(shape) if self.reduce is not None else None
                if staged is not None and self.reduce is not None:
                    quant_matmul(x, inner.qweight, out=staged)
                    return self.reduce.sum_staged(staged).to(x.dtype)
                y = torch.empty(shape, dtype=torch.float32, device=x.device)
                return self._sum(quant_matmul(x, inner.qweight, out=y)).to(x.dtype)
            # The CPU's QuantizedLinear keeps a float32 copy of the weight: take that path.
            y32: torch.Tensor = inner(x.float()).contiguous()
            return self._sum(y32).to(x.dtype)
        y = inner(x)
        prompt = self.prompt_sites
        if prompt is not None and y.dtype == prompt.buffers.data.dtype:
            # The sites take the two slices in turn (site_reduce.PROMPT_SLOTS says why).
            slot = self.site % PROMPT_SLOTS
            staged = prompt.staging(slot, tuple(y.shape))
            if staged is not None:
                staged.copy_(y)
                if self.defer_sum and self.fuse_kernels:
                    # Summed inside the next norm's add, as a decode row's partial is: one
                    # pass over the sum fewer (fused_sites.ReducingRMSNorm).
                    return prompt.defer(slot, staged)
                return prompt.sum(slot, staged, y.dtype)
        return self._sum(y.contiguous())


def use_all_reduce(model: nn.Module, reduce: GroupAllReduce) -> None:
    """Give every row-parallel linear of a sharded model the rank's GroupAllReduce, and
    where it has symmetric memory, the site all-reduce for decode (a collective: every rank
    calls this at the same point)."""
    for module in model.modules():
        if isinstance(module, (AllReduceLinear, VocabParallelEmbedding)):
            module.reduce = reduce
    # The buffer's presence is agreed by every rank (GroupAllReduce); KESTREL_TP_FUSED is
    # each rank's own, so it goes into the site set-up's vote rather than skip it here.
    if reduce.buffer is not None and isinstance(model, CausalLM):
        _use_sites(model, reduce, reduce.buffer.device, enabled=fused_enabled())


def _site_eligible(linear: AllReduceLinear) -> bool:
    # The quantized GEMV writes its float32 partial into the site's slice (forward).
    inner = linear.inner
    return isinstance(inner, QuantizedLinear) and inner.out_features == inner.qweight.out_features


def _use_sites(
    model: CausalLM, reduce: GroupAllReduce, device: torch.device, *, enabled: bool
) -> None:
    """The site all-reduce for every row-parallel linear whose GEMV can write its partial
    into a site (quantized, unpadded), at least two of them: in a forward either all of
    them take the sites or none (same rows, same width), which the race argument in
    kernels/tp_all_reduce.py needs. The others (dense layers) keep their path."""
    linears = [m for m in model.modules() if isinstance(m, AllReduceLinear) and _site_eligible(m)]
    widths = {linear.out_features for linear in linears}
    if len(linears) < 2 or len(widths) != 1:
        return
    width = widths.pop()
    sites = SiteAllReduce.build(reduce.group, device, len(linears), width, enabled=enabled)
    if sites is None:
        return
    # After the decode sites, at the same point on every rank (a collective). An even
    # number of sites, so that consecutive calls take alternate slices across forwards too
    # (site_reduce.PROMPT_SLOTS); the same on every rank (one model).
    prompt = None
    if len(linears) % PROMPT_SLOTS == 0:
        prompt = SiteAllReduce.build_prompt(
            reduce.group, device, width, model.embed_dtype, enabled=enabled
        )
    for linear in linears:
        linear.fuse_kernels = model.fuse_kernels  # set_kernel_fusion switches both
    deferred = wire_sites(model.model.layers, linears, sites, prompt)
    log.info(
        "tensor parallel: %d decode all-reduces on the site kernel, %d of them fused with "
        "the next residual add + norm; prompt rows on %s",
        len(linears),
        deferred,
        "the site kernel" if prompt is not None else "NCCL",
    )


def _row_shard(linear: nn.Module, inputs: torch.Tensor, *, rank: int) -> nn.Module:
    """Row-parallel shard of `linear` reading original inputs lo..hi-1 (a contiguous range)."""
    lo, hi = int(inputs[0]), int(inputs[-1]) + 1
    if isinstance(linear, QuantizedLinear):
        rows, perm = rows_of_inputs(linear.qweight, lo, hi)
        return shard_rows_quantized(linear, rows, perm, keep_bias=rank == 0)
    if isinstance(linear, Linear):
        return shard_rows_dense(linear, inputs, keep_bias=rank == 0)
    raise TensorParallelError(f"cannot shard a {type(linear).__name__} by rows")


def attention_inputs(
    attn: Attention, *, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The query features (o_proj's inputs) and the K (or V) features this rank computes:
    its KV heads and the query heads that read them."""
    s = attn.spec
    if s.num_kv_heads % world or s.num_heads % world:
        raise TensorParallelError(
            f"layer {attn.layer_idx}: {s.num_heads} query and {s.num_kv_heads} KV heads do not "
            f"divide among {world} ranks (tensor parallelism shards whole KV heads)"
        )
    hq, hk, d = s.num_heads // world, s.num_kv_heads // world, s.head_dim
    q_in = torch.arange(rank * hq * d, (rank + 1) * hq * d)
    kv = torch.arange(rank * hk * d, (rank + 1) * hk * d)
    return q_in, kv


def shard_attention(
    attn: Attention,
    *,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None,
    loaded: bool = False,
) -> None:
    """`loaded`: the load read only this rank's parts (cut_load.py): wrap o_proj, set the
    local heads, cut nothing."""
    s = attn.spec
    q_in, kv = attention_inputs(attn, rank=rank, world=world)
    hq, hk = s.num_heads // world, s.num_kv_heads // world
    if loaded:
        attn.o_proj = AllReduceLinear(attn.o_proj, group)
        attn.spec = replace(s, num_heads=hq, num_kv_heads=hk)
        return
    d = s.head_dim
    if s.fused_qkv:
        q_size, kv_size = s.num_heads * d, s.num_kv_heads * d
        cols = torch.cat([q_in, q_size + kv, q_size + kv_size + kv])
        attn.qkv_proj = shard_columns(attn.qkv_proj, cols)
    else:
        attn.q_proj = shard_columns(attn.q_proj, q_in)
        attn.k_proj = shard_columns(attn.k_proj, kv)
        attn.v_proj = shard_columns(attn.v_proj, kv)
    attn.o_proj = AllReduceLinear(_row_shard(attn.o_proj, q_in, rank=rank), group)
    attn.spec = replace(s, num_heads=hq, num_kv_heads=hk)


def mlp_inputs(
    row_group: torch.Tensor | None, size: int, *, rank: int, world: int, interleave: bool = False
) -> torch.Tensor:
    """The down projection's rows this rank keeps. Quantized (`row_group`: the group of each
    runtime row, `size` groups): whole groups, an even contiguous block of them, or with
    `interleave` round-robin, group g on rank g % world (EXL2: see the module docstring).
    Dense (None; `size` inputs): an even contiguous share."""
    if row_group is None:
        inputs = torch.tensor_split(torch.arange(size), world)[rank]
        if inputs.numel() == 0:
            raise TensorParallelError(f"{size} MLP columns for {world} ranks")
        return inputs
    if interleave:
        mine = row_group % world == rank
    else:
        block = torch.tensor_split(torch.arange(size), world)[rank]
        lo, hi = (int(block[0]), int(block[-1]) + 1) if block.numel() else (0, 0)
        mine = (row_group >= lo) & (row_group < hi)
    rows = torch.nonzero(mine).flatten()
    if rows.numel() == 0:
        raise TensorParallelError(
            f"down_proj has {size} quantization groups, fewer than {world} ranks"
        )
    return rows


def _mlp_inputs(down: nn.Module, *, rank: int, world: int) -> tuple[torch.Tensor, nn.Module]:
    """The intermediate columns this rank computes, and its down_proj shard reading them
    in that order."""
    if isinstance(down, QuantizedLinear):
        qw = down.qweight
        rows = mlp_inputs(
            qw.row_group.long().cpu(),
            qw.num_groups,
            rank=rank,
            world=world,
            interleave=down.format == "exl2",
        )
        inputs = rows if qw.perm is None else qw.perm.long().cpu()[rows]
        # The rank's MLP input arrives in the order of `rows`: no permutation left.
        return inputs, shard_rows_quantized(down, rows, None, keep_bias=rank == 0)
    if isinstance(down, Linear):
        inputs = mlp_inputs(None, down.in_features, rank=rank, world=world)
        return inputs, shard_rows_dense(down, inputs, keep_bias=rank == 0)
    raise TensorParallelError(f"cannot shard a {type(down).__name__} down projection")


def shard_mlp(
    mlp: GatedMLP | FusedGatedMLP,
    *,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None,
    loaded: bool = False,
) -> None:
    """`loaded`: as for shard_attention (down_proj wrapped, nothing cut)."""
    if loaded:
        mlp.down_proj = AllReduceLinear(mlp.down_proj, group)
        return
    inputs, down = _mlp_inputs(mlp.down_proj, rank=rank, world=world)
    if isinstance(mlp, FusedGatedMLP) or mlp.gate_up_proj is not None:
        # Stored so (Phi-3) or built so by the build plan: [gate | up] columns.
        assert mlp.gate_up_proj is not None
        intermediate = linear_features(mlp.down_proj)[0]
        mlp.gate_up_proj = shard_columns(
            mlp.gate_up_proj, torch.cat([inputs, intermediate + inputs])
        )
    else:
        mlp.gate_proj = shard_columns(mlp.gate_proj, inputs)
        mlp.up_proj = shard_columns(mlp.up_proj, inputs)
    mlp.down_proj = AllReduceLinear(down, group)


def shard_model(
    model: CausalLM,
    *,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None = None,
    loaded: LoadedVocab | None = None,
) -> CausalLM:
    """Shard every attention and gated MLP, the embeddings and the head of `model` in place
    for `rank` of `world`. `loaded`: the load read only this rank's parts of the weights
    (cut_load.RankCuts), and these are the whole vocabulary's sizes; what is left is wrapping
    the parts into the rank's modules."""
    if world < 1 or not 0 <= rank < world:
        raise TensorParallelError(f"rank {rank} of world size {world} is not valid")
    cut = loaded is not None
    layers = model.model.layers
    for index, layer in enumerate(layers):
        attns = [m for m in layer.modules() if isinstance(m, Attention)]
        mlps = [m for m in layer.modules() if isinstance(m, (GatedMLP, FusedGatedMLP))]
        if len(attns) != 1 or len(mlps) != 1:
            raise TensorParallelError(
                f"layer {index} ({type(layer).__name__}) is not one attention + one gated MLP: "
                "tensor parallelism supports dense decoder layers only (not mixture-of-experts)"
            )
        shard_attention(attns[0], rank=rank, world=world, group=group, loaded=cut)
        shard_mlp(mlps[0], rank=rank, world=world, group=group, loaded=cut)
    shard_vocab(model, rank=rank, world=world, group=group, loaded=loaded)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.qweight.validate()
    return model


def move_model(model: CausalLM, device: torch.device) -> CausalLM:
    """Move parameters and quantized weights (plain attributes, not buffers) to `device`."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.qweight = module.qweight.to(device)
    model.to(device)
    model.layer_devices = [device] * len(model.model.layers)
    return model
