"""A tensor-parallel rank reads only its part of each linear, of the embeddings and the head.

A rank used to load the whole checkpoint (and repack every quantized linear) and then cut
its shard (transform.py), so each of W ranks read the whole model: a 70B TP=2 load took
2.4x one GPU's. `RankCuts` is the load's `WeightCuts` (engine/loading.py): before any weight
is read it decides, from the model built on the meta device and the store's small tensors
(g_idx; EXL2's q_groups and q_invperm), what the rank keeps of each stored linear, exactly
as transform.py decides it on the loaded model. Then each linear is read in part: the
smallest self-contained piece of the stored tensors that holds the rank's part (a "mini"
linear, valid in its format), repacked as usual, and cut by the same functions of shard.py
with indices local to the piece. The shard is the one the whole load would have cut, byte
for byte (tests/engine/test_tensor_parallel_cut_load.py compares every tensor).

- Columns (out features: q/k/v, gate/up, the head's vocabulary): the output axis is never
  packed in the codes, so the piece is the runs of the rank's columns, widened to whole
  words of what packs columns (GPTQ qzeros, EXL2 q_scale: 8 columns a word at 4 bits).
- GPTQ rows (in features: o_proj, down_proj): qweight packs the input rows in their original
  order, 32/bits a word. The piece is the words holding the rank's rows, with their groups'
  scales and zeros (renumbered in order) and a g_idx for its rows: o_proj's rows are an input
  range (contiguous even with act-order), down_proj's block of whole groups is contiguous
  without act-order, and so are the gate/up columns it reads (transform.py), one run a row.
  With act-order a down_proj's groups scatter their rows over the whole tensor: the words
  then cover about all of it, and that read is whole (stated, not avoided); so are gate/up's.
- EXL2 rows: q_weight packs the stored (permuted) rows group by group, so the piece is the
  rank's groups: a down_proj's round-robin groups are read alone. An o_proj's input range
  is scattered over every group by q_perm (the act-order EXL2 writes), so that piece is the
  whole linear: the full read, then the cut, as before. Finer pieces (32-row blocks within
  groups) would save little: act-order spreads one head's rows over almost every block.
- Dense weights: rows of [out, in] for columns, columns of it for rows; the embedding table
  and a dense head by vocabulary rows.

Where a part is spread over more than MAX_RUNS runs, the whole tensor is read (one read
beats thousands of slices) and cut in memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.linears import linear_features
from engine.modules import Attention, FusedGatedMLP, GatedMLP, Linear
from engine.quant.exl2 import Exl2Group, Exl2Tensors, exl2_row_group
from engine.quant.gptq import gptq_row_order, infer_group_size
from engine.quantized_linear import QuantizedLinear, linear_format, load_quantized_linear
from engine.tensor_parallel.shard import shard_columns, shard_rows_quantized
from engine.tensor_parallel.vocab import LoadedVocab, vocab_range
from engine.weights import WeightError, WeightStore

# More runs than this in one part: read the whole tensor and cut it in memory.
MAX_RUNS = 1024

Runs = list[tuple[int, int]]


@dataclass(frozen=True)
class Columns:
    """Output features `cols` (int64), in this order."""

    cols: torch.Tensor


@dataclass(frozen=True)
class Rows:
    """Input features. Quantized: the runtime rows kept (increasing) and the permutation of
    the rank's local input (transform.py's choice); dense: `inputs`, the original features
    in the rank's local order. The bias stays on one rank (the partial sums add up)."""

    rows: torch.Tensor | None
    perm: torch.Tensor | None
    inputs: torch.Tensor
    keep_bias: bool


@dataclass(frozen=True)
class _Order:
    """A quantized linear's runtime row order, from its small tensors."""

    perm: torch.Tensor | None  # int64 [k]: runtime row -> original input, None: identity
    row_group: torch.Tensor  # int64 [k]: the group of each runtime row
    groups: torch.Tensor | None  # GPTQ: the group of each original input row
    exl2_groups: list[Exl2Group] | None


def runs_of(values: torch.Tensor) -> Runs:
    """Maximal runs [a, b) of consecutive integers in sorted, distinct `values` (found with
    tensor operations: a vocabulary part has 64k values, and a 70B load makes thousands of
    these calls)."""
    v = values.long().flatten()
    if v.numel() == 0:
        return []
    breaks = torch.nonzero(v[1:] != v[:-1] + 1).flatten() + 1
    starts = torch.cat([v[:1], v[breaks]])
    ends = torch.cat([v[breaks - 1] + 1, v[-1:] + 1])
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def covering_runs(index: torch.Tensor, align: int, size: int) -> Runs:
    """Runs of whole `align`-blocks (clipped to `size`) holding every value of `index`, or the
    whole range where they would be too many."""
    blocks = torch.unique(index.long() // align)
    runs = [(a * align, min(b * align, size)) for a, b in runs_of(blocks)]
    return [(0, size)] if len(runs) > MAX_RUNS else runs


def local_index(index: torch.Tensor, runs: Runs) -> torch.Tensor:
    """Where each value of `index` sits in the concatenation of `runs`."""
    bounds = torch.tensor(runs, dtype=torch.long).reshape(-1, 2)
    starts = bounds[:, 0].contiguous()
    lengths = bounds[:, 1] - starts
    offsets = torch.cumsum(lengths, 0) - lengths
    which = torch.searchsorted(starts, index.long(), right=True) - 1
    return index.long() - starts[which] + offsets[which]


def _words(runs: Runs, per_word: int) -> Runs:
    return [(a // per_word, -(-b // per_word)) for a, b in runs]


class RankCuts:
    """What rank `rank` of `world` reads of each stored tensor (engine.loading.WeightCuts)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.cuts: dict[str, Columns | Rows] = {}
        self._orders: dict[str, _Order] = {}
        self.vocab: LoadedVocab | None = None  # set by prepare
        # Host seconds deciding the parts and cutting pieces (load_phases.py's counts).
        self.plan_seconds = 0.0
        self.cut_seconds = 0.0
        # Host seconds in load_quantized_linear for the pieces read: the move to the device
        # where a piece was read elsewhere, validation and repacking, and (on a GPU) the
        # waits its reads of the device forced on the copies queued before.
        self.repack_seconds = 0.0

    # --- deciding the parts ----------------------------------------------------------------

    def prepare(self, model: nn.Module, store: WeightStore) -> None:
        started = time.perf_counter()
        try:
            self._prepare(model, store)
        finally:
            self.plan_seconds += time.perf_counter() - started

    def _prepare(self, model: nn.Module, store: WeightStore) -> None:
        from engine.tensor_parallel.transform import attention_inputs, mlp_inputs

        for name, module in model.named_modules():
            if isinstance(module, Attention):
                q_in, kv = attention_inputs(module, rank=self.rank, world=self.world)
                self._attention(store, name, module, q_in, kv)
            elif isinstance(module, (GatedMLP, FusedGatedMLP)):
                down = f"{name}.down_proj"
                in_features = linear_features(module.down_proj)[0]
                if linear_format(store, down) == "dense":
                    inputs = mlp_inputs(None, in_features, rank=self.rank, world=self.world)
                    self.cuts[down] = Rows(None, None, inputs, self.rank == 0)
                else:
                    order = self._order(store, down, in_features)
                    num_groups = int(order.row_group.max()) + 1
                    rows = mlp_inputs(
                        order.row_group,
                        num_groups,
                        rank=self.rank,
                        world=self.world,
                        interleave=order.exl2_groups is not None,  # as transform.py
                    )
                    inputs = rows if order.perm is None else order.perm[rows]
                    self.cuts[down] = Rows(rows, None, inputs, self.rank == 0)
                self._gate_up(name, module, inputs, in_features)
        self._vocab(model, store)

    def _attention(
        self,
        store: WeightStore,
        name: str,
        attn: Attention,
        q_in: torch.Tensor,
        kv: torch.Tensor,
    ) -> None:
        s = attn.spec
        parts = dict(getattr(attn, "load_sources", {})).get("qkv_proj")
        if parts is not None:  # built fused from the stored q/k/v
            for (leaf, _), cols in zip(parts, (q_in, kv, kv), strict=True):
                self.cuts[f"{name}.{leaf}"] = Columns(cols)
        elif s.fused_qkv:  # stored fused
            q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            cols = torch.cat([q_in, q_size + kv, q_size + kv_size + kv])
            self.cuts[f"{name}.qkv_proj"] = Columns(cols)
        else:
            for leaf, cols in (("q_proj", q_in), ("k_proj", kv), ("v_proj", kv)):
                self.cuts[f"{name}.{leaf}"] = Columns(cols)
        o_proj = f"{name}.o_proj"
        lo, hi = int(q_in[0]), int(q_in[-1]) + 1
        keep = self.rank == 0
        if linear_format(store, o_proj) == "dense":
            self.cuts[o_proj] = Rows(None, None, q_in, keep)
            return
        order = self._order(store, o_proj, linear_features(attn.o_proj)[0])
        if order.perm is None:
            self.cuts[o_proj] = Rows(torch.arange(lo, hi), None, q_in, keep)
        else:  # as shard.rows_of_inputs
            rows = torch.nonzero((order.perm >= lo) & (order.perm < hi)).flatten()
            self.cuts[o_proj] = Rows(rows, order.perm[rows] - lo, q_in, keep)

    def _gate_up(
        self, name: str, mlp: GatedMLP | FusedGatedMLP, inputs: torch.Tensor, intermediate: int
    ) -> None:
        parts = dict(getattr(mlp, "load_sources", {})).get("gate_up_proj")
        if parts is not None:
            for leaf, _ in parts:
                self.cuts[f"{name}.{leaf}"] = Columns(inputs)
        elif isinstance(mlp, FusedGatedMLP) or getattr(mlp, "gate_up_proj", None) is not None:
            self.cuts[f"{name}.gate_up_proj"] = Columns(torch.cat([inputs, intermediate + inputs]))
        else:
            self.cuts[f"{name}.gate_proj"] = Columns(inputs)
            self.cuts[f"{name}.up_proj"] = Columns(inputs)

    def _vocab(self, model: nn.Module, store: WeightStore) -> None:
        embed = "model.embed_tokens"
        table = model.get_submodule(embed).weight
        assert isinstance(table, torch.Tensor)
        table_rows = int(table.shape[0])
        head_vocab = linear_features(model.get_submodule("lm_head"))[1]
        self.vocab = LoadedVocab(table_rows, head_vocab)
        lo, hi = vocab_range(table_rows, self.rank, self.world)
        self.cuts[embed] = Columns(torch.arange(lo, hi))
        if linear_format(store, "lm_head") != "dense" or "lm_head.weight" in store:
            lo, hi = vocab_range(head_vocab, self.rank, self.world)
            self.cuts["lm_head"] = Columns(torch.arange(lo, hi))
        # A tied head is the embedding's rows (the load ties it to the cut table).

    def _order(self, store: WeightStore, name: str, in_features: int) -> _Order:
        """The runtime row order of quantized linear `name`, as gptq_to_runtime and
        exl2_to_runtime make it, read from its small tensors only."""
        if name in self._orders:
            return self._orders[name]
        k = in_features
        if linear_format(store, name) == "gptq":
            if f"{name}.g_idx" in store:
                g = store.get(f"{name}.g_idx").long()
            else:
                num_groups = store.info(f"{name}.scales").shape[0]
                try:
                    g = torch.arange(k) // infer_group_size(k, num_groups)
                except ValueError as e:
                    raise WeightError(f"{name}: {e} (no g_idx)") from None
            perm, row_group = gptq_row_order(g)
            order = _Order(perm, row_group, g, None)
        else:
            info = store.info(f"{name}.q_weight")
            exl2 = Exl2Tensors(
                q_weight=torch.empty(info.shape, dtype=info.dtype, device="meta"),
                q_scale=torch.empty(0),
                q_scale_max=torch.empty(0),
                q_groups=store.get(f"{name}.q_groups"),
                q_invperm=store.get(f"{name}.q_invperm"),
            )
            groups = exl2.groups(name)
            perm = torch.argsort(exl2.q_invperm.long())
            identity = bool((perm == torch.arange(perm.numel())).all())
            row_group = exl2_row_group(groups, torch.device("cpu")).long()
            order = _Order(None if identity else perm, row_group, None, groups)
        self._orders[name] = order
        return order

    # --- reading the parts ------------------------------------------------------------------

    def read_quantized(
        self,
        store: WeightStore,
        name: str,
        *,
        in_features: int,
        out_features: int,
        device: torch.device,
        quantization_config: dict[str, Any] | None,
    ) -> Callable[[], nn.Module] | None:
        cut = self.cuts.get(name)
        if cut is None:
            return None
        fmt = linear_format(store, name)

        def load(tensors: dict[str, torch.Tensor], k: int, n: int) -> QuantizedLinear:
            started = time.perf_counter()
            try:
                return load_quantized_linear(
                    store,
                    name,
                    in_features=k,
                    out_features=n,
                    device=device,
                    quantization_config=quantization_config,
                    tensors=tensors,
                )
            finally:
                self.repack_seconds += time.perf_counter() - started

        if isinstance(cut, Columns):
            if int(cut.cols.max()) >= out_features:
                raise ValueError(f"column {int(cut.cols.max())} outside {out_features} outputs")
            if fmt == "gptq":
                tensors, runs = self._gptq_columns(
                    store, name, cut.cols, quantization_config, in_features, device
                )
            else:
                tensors, runs = self._exl2_columns(store, name, cut.cols, device)
            width = sum(b - a for a, b in runs)
            local = local_index(cut.cols, runs)
            in_order = local.numel() == width and bool((local == torch.arange(width)).all())

            def build_columns() -> nn.Module:
                piece = load(tensors, in_features, width)
                if in_order:
                    return piece  # the piece is the part, in order: nothing left to cut
                return self._timed_cut(lambda: shard_columns(piece, local))

            return build_columns
        rows_cut = cut
        assert rows_cut.rows is not None
        if fmt == "gptq":
            tensors, rows = self._gptq_rows(
                store, name, rows_cut.rows, in_features, quantization_config, device
            )
            k = tensors["g_idx"].numel()
        else:
            tensors, rows = self._exl2_rows(store, name, rows_cut.rows, in_features, device)
            k = tensors["q_invperm"].numel()

        def build_rows() -> nn.Module:
            piece = load(tensors, k, out_features)
            kept = rows
            if fmt == "gptq" and piece.qweight.perm is not None:
                # rows of the piece, in its runtime order
                kept = torch.argsort(piece.qweight.perm.long().cpu())[rows]
            return self._timed_cut(
                lambda: shard_rows_quantized(
                    piece, kept, rows_cut.perm, keep_bias=rows_cut.keep_bias
                )
            )

        return build_rows

    def _timed_cut(self, cut: Callable[[], nn.Module]) -> nn.Module:
        started = time.perf_counter()
        try:
            return cut()
        finally:
            self.cut_seconds += time.perf_counter() - started

    def _gptq_bits(self, store: WeightStore, name: str, qcfg: dict[str, Any] | None, k: int) -> int:
        bits = (qcfg or {}).get("bits")
        return int(bits) if bits is not None else store.info(f"{name}.qweight").shape[0] * 32 // k

    def _gptq_columns(
        self,
        store: WeightStore,
        name: str,
        cols: torch.Tensor,
        qcfg: dict[str, Any] | None,
        k: int,
        device: torch.device,
    ) -> tuple[dict[str, torch.Tensor], Runs]:
        p = f"{name}."
        n = store.info(p + "qweight").shape[1]
        per_word = 32 // self._gptq_bits(store, name, qcfg, k)  # qzeros packs columns so
        runs = covering_runs(cols, per_word, n)
        # Read onto the device the piece is repacked on: a GPU's bytes go through the
        # store's pinned buffers and asynchronous copies (engine/staged_reads.py).
        tensors = {
            "qweight": store.get_part(p + "qweight", 1, runs, device=device),
            "scales": store.get_part(p + "scales", 1, runs, device=device),
            "qzeros": store.get_part(p + "qzeros", 1, _words(runs, per_word), device=device),
        }
        if p + "g_idx" in store:
            tensors["g_idx"] = store.get(p + "g_idx")
        if p + "bias" in store:
            tensors["bias"] = store.get_part(p + "bias", 0, runs)
        return tensors, runs

    def _exl2_columns(
        self, store: WeightStore, name: str, cols: torch.Tensor, device: torch.device
    ) -> tuple[dict[str, torch.Tensor], Runs]:
        p = f"{name}."
        width = store.info(p + "q_weight").shape[1]
        # q_scale packs 8 columns a word; the stored width is a multiple of 8 (validated).
        runs = covering_runs(cols, 8, width)
        tensors = {
            "q_weight": store.get_part(p + "q_weight", 1, runs, device=device),
            "q_scale": store.get_part(p + "q_scale", 1, _words(runs, 8), device=device),
            "q_scale_max": store.get(p + "q_scale_max"),
            "q_groups": store.get(p + "q_groups"),
            "q_invperm": store.get(p + "q_invperm"),
        }
        if p + "bias" in store:
            # Stored unpadded or padded to the width; the runtime pads it to the width.
            bias = store.get(p + "bias")
            bias = F.pad(bias[:width], (0, width - min(width, bias.numel())))
            tensors["bias"] = torch.cat([bias[a:b] for a, b in runs])
        return tensors, runs

    def _gptq_rows(
        self,
        store: WeightStore,
        name: str,
        rows: torch.Tensor,
        k: int,
        qcfg: dict[str, Any] | None,
        device: torch.device,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The words of qweight holding the rank's rows (in the original order), their
        groups renumbered in order, and where each kept runtime row sits among the piece's
        rows (in the original order)."""
        p = f"{name}."
        order = self._order(store, name, k)
        assert order.groups is not None
        per_word = 32 // self._gptq_bits(store, name, qcfg, k)
        original = rows if order.perm is None else order.perm[rows]
        words = torch.unique(original // per_word)
        word_runs = runs_of(words)
        if len(word_runs) > MAX_RUNS:
            word_runs = [(0, k // per_word)]
        piece_rows = torch.cat([torch.arange(a * per_word, b * per_word) for a, b in word_runs])
        groups = order.groups[piece_rows]
        used = torch.unique(groups)
        group_runs = runs_of(used)
        tensors = {
            "qweight": store.get_part(p + "qweight", 0, word_runs, device=device),
            "scales": store.get_part(p + "scales", 0, group_runs, device=device),
            "qzeros": store.get_part(p + "qzeros", 0, group_runs, device=device),
            "g_idx": torch.searchsorted(used, groups).to(torch.int32),
        }
        if p + "bias" in store:
            tensors["bias"] = store.get(p + "bias")
        return tensors, torch.searchsorted(piece_rows, original)

    def _exl2_rows(
        self, store: WeightStore, name: str, rows: torch.Tensor, k: int, device: torch.device
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The rank's groups (whole) as one EXL2 linear of their rows in the stored order,
        and where each kept row sits in it."""
        p = f"{name}."
        order = self._order(store, name, k)
        assert order.exl2_groups is not None
        used = torch.unique(order.row_group[rows]).tolist()
        chosen = [order.exl2_groups[g] for g in used]
        pairs: list[int] = []
        start = {}
        qrow, row = 0, 0
        for g, grp in zip(used, chosen, strict=True):
            pairs += [grp.bits, qrow]
            start[g] = row
            qrow += grp.qrow_end - grp.qrow_start
            row += grp.row_end - grp.row_start
        qrow_runs = runs_of(
            torch.cat([torch.arange(grp.qrow_start, grp.qrow_end) for grp in chosen])
        )
        group_runs = runs_of(torch.tensor(used))
        tensors = {
            "q_weight": store.get_part(p + "q_weight", 0, qrow_runs, device=device),
            "q_scale": store.get_part(p + "q_scale", 0, group_runs, device=device),
            "q_scale_max": store.get_part(p + "q_scale_max", 0, group_runs, device=device),
            # exllamav2 reads the offsets as uint16: stored as int16, wrapping.
            "q_groups": torch.tensor(pairs, dtype=torch.int32).to(torch.int16),
            # The piece's rows stay in the stored order: the cut gets its own permutation.
            "q_invperm": torch.arange(row, dtype=torch.int32),
        }
        if p + "bias" in store:
            tensors["bias"] = store.get(p + "bias")
        group_of = order.row_group[rows]
        first = torch.tensor(
            [order.exl2_groups[g].row_start for g in range(len(order.exl2_groups))]
        )
        piece_start = torch.zeros(len(order.exl2_groups), dtype=torch.long)
        for g, s in start.items():
            piece_start[g] = s
        return tensors, rows - first[group_of] + piece_start[group_of]

    def dense(
        self,
        store: WeightStore,
        linear: str,
        leaf: str,
        *,
        dtype: torch.dtype,
        device: torch.device,
        shape: tuple[int, ...],
    ) -> torch.Tensor | None:
        cut = self.cuts.get(linear)
        if cut is None:
            return None
        name = f"{linear}.{leaf}"
        info = store.info(name)
        if info.shape != tuple(shape):
            raise WeightError(
                f"tensor '{name}' in {info.file.name} has shape {list(info.shape)}, "
                f"the model expects {list(shape)}"
            )
        if isinstance(cut, Columns):  # rows of weight [out, in] (or of the bias)
            index, dim = cut.cols, 0
        elif len(shape) == 1:  # a row-parallel linear's bias: whole (dropped off rank 0 after)
            return store.get(name, dtype=dtype, device=device)
        else:
            index, dim = cut.inputs, 1
        if int(index.max()) >= shape[dim]:
            raise WeightError(f"tensor '{name}': index {int(index.max())} beyond {shape[dim]}")
        runs = covering_runs(index, 1, shape[dim])
        part = store.get_part(name, dim, runs, dtype=dtype, device=device)
        local = local_index(index, runs)
        if bool((local == torch.arange(local.numel())).all()) and local.numel() == part.shape[dim]:
            return part
        return part.index_select(dim, local.to(part.device)).contiguous()

    def finish(self, model: nn.Module) -> None:
        """Make the dense linears read as what they hold now (the load set their cut
        parameters), and drop a row-parallel linear's bias off every rank but one."""
        for name, module in model.named_modules():
            if type(module) is Linear and module.weight.device.type != "meta":
                module.out_features, module.in_features = module.weight.shape
                cut = self.cuts.get(name)
                if isinstance(cut, Rows) and not cut.keep_bias:
                    module.bias = None
