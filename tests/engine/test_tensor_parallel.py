"""Tensor parallelism on the CPU: exact shards of quantized linears (EXL2 mixed bits with
act-order, GPTQ act-order), and two real gloo processes running a tiny Llama whose layers
are FP16, EXL2 and GPTQ, with the same logits and greedy tokens as one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import loader
from engine.config import ModelConfig
from engine.loading import load_causal_lm
from engine.placement import Placement
from engine.placement.plan import ModelFootprint
from engine.quant.exl2 import Exl2Tensors, exl2_to_runtime
from engine.quant.exl2_writer import quantize_rtn_exl2
from engine.quant.gptq import GptqTensors, gptq_to_runtime, quantize_rtn_gptq
from engine.quantized_linear import QuantizedLinear
from engine.tensor_parallel.shard import quantized_columns, quantized_rows, rows_of_inputs
from engine.tensor_parallel.staging import staging_placement
from engine.tensor_parallel.transform import _mlp_inputs, move_model, shard_model
from helpers.mixed_model import build_mixed_model
from kernels.quant_matmul import dequantize_reference, quant_matmul_reference
from loader.base import UnsupportedFeatureError

K, N = 256, 96


def _exl2_weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(N, K, generator=g)
    bits = [8, 6, 6, 5, 4, 4, 3, 2]  # 32-row groups, non-increasing as EXL2 requires
    packed = quantize_rtn_exl2(w, bits, 32, perm=torch.randperm(K, generator=g))
    return exl2_to_runtime(Exl2Tensors.from_dict(packed))


def _gptq_weight() -> torch.Tensor:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(2))
    packed = quantize_rtn_gptq(w, 4, 32, sym=False, act_order=True, v2=False)
    return gptq_to_runtime(GptqTensors.from_dict(packed, bits=4, checkpoint_format="gptq"))


WEIGHTS = {"exl2": _exl2_weight, "gptq": _gptq_weight}


@pytest.mark.parametrize("fmt", WEIGHTS)
def test_column_shards_hold_exactly_those_columns(fmt: str):
    qw = WEIGHTS[fmt]()
    full = dequantize_reference(qw)
    cols = torch.tensor([5, 0, 95, 17, 18, 40])  # any index set: fused q|k|v pieces
    shard = quantized_columns(qw, cols)
    shard.validate()
    assert torch.equal(dequantize_reference(shard), full[:, cols])


@pytest.mark.parametrize("fmt", WEIGHTS)
def test_row_shards_by_input_range_are_exact_and_sum_to_the_product(fmt: str):
    qw = WEIGHTS[fmt]()
    assert qw.perm is not None  # act-order: the rows of a range lie scattered
    full = dequantize_reference(qw)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(3))
    total = torch.zeros(3, N)
    bits = sorted(s.bits for s in qw.segments)
    shard_bits: set[int] = set()
    for lo, hi in ((0, 96), (96, K)):  # uneven on purpose
        rows, perm = rows_of_inputs(qw, lo, hi)
        shard = quantized_rows(qw, rows, perm, keep_bias=lo == 0)
        shard.validate()
        assert torch.equal(dequantize_reference(shard), full[lo:hi])
        total += quant_matmul_reference(x[:, lo:hi], shard)
        shard_bits.update(s.bits for s in shard.segments)
    torch.testing.assert_close(total, quant_matmul_reference(x, qw), rtol=1e-5, atol=1e-4)
    assert shard_bits == set(bits)  # codes were repacked at their own widths


@pytest.mark.parametrize("fmt", WEIGHTS)
@pytest.mark.parametrize(
    "rows",
    [range(64, 128), range(5, 70), [*range(0, 32), *range(96, 128), 200, 255], range(250, K)],
    ids=["whole-groups", "mid-word", "runs-and-strays", "segment-end"],
)
def test_any_row_subset_repacks_exactly(fmt: str, rows):
    """Whole-word runs are sliced, the rest unpacked and repacked: the same codes either way."""
    qw = WEIGHTS[fmt]()
    selected = torch.tensor(list(rows))
    shard = quantized_rows(qw, selected, None, keep_bias=False)
    shard.validate()
    assert torch.equal(dequantize_reference(shard), _permuted(qw)[selected])


def _permuted(qw) -> torch.Tensor:
    """The dequantized weight in permuted (storage) row order."""
    full = dequantize_reference(qw)
    return full if qw.perm is None else full[qw.perm.long()]


@pytest.mark.parametrize("fmt", WEIGHTS)
def test_mlp_down_shards_take_whole_groups(fmt: str):
    """GPTQ ranks take an even contiguous block of whole groups, EXL2 ranks every W-th
    group (its bit widths fall group by group: a block would give rank 0 the widest)."""
    qw = WEIGHTS[fmt]()
    full = dequantize_reference(qw)
    module = QuantizedLinear(qw, N, fmt)
    groups = qw.row_group.long()
    seen = []
    for rank in range(2):
        inputs, down = _mlp_inputs(module, rank=rank, world=2)
        shard = down.qweight
        assert shard.perm is None  # the rank's input already comes in the shard's row order
        assert torch.equal(dequantize_reference(shard), full[inputs])
        # Whole groups: every local group has as many rows as the original groups (32).
        assert torch.bincount(shard.row_group.long()).tolist() == [32] * (K // 64)
        rows = inputs if qw.perm is None else torch.argsort(qw.perm.long())[inputs]
        kept = torch.unique(groups[rows]).tolist()
        assert kept == (list(range(4 * rank, 4 * rank + 4)) if fmt == "gptq" else
                        list(range(rank, 8, 2)))  # fmt: skip
        seen.append(inputs)
    assert sorted(torch.cat(seen).tolist()) == list(range(K))


def test_gptq_without_act_order_gives_each_rank_a_contiguous_block_of_mlp_columns():
    """Then a rank reads one run of each gate/up row and one block of down_proj's rows
    (cut_load.py), not whole rows: its MLP columns are inputs [r*K/W, (r+1)*K/W)."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(4))
    packed = quantize_rtn_gptq(w, 4, 32, sym=False, act_order=False, v2=False)
    qw = gptq_to_runtime(GptqTensors.from_dict(packed, bits=4, checkpoint_format="gptq"))
    assert qw.perm is None
    module = QuantizedLinear(qw, N, "gptq")
    for rank in range(2):
        inputs, down = _mlp_inputs(module, rank=rank, world=2)
        assert torch.equal(inputs, torch.arange(rank * K // 2, (rank + 1) * K // 2))
        assert torch.equal(dequantize_reference(down.qweight), dequantize_reference(qw)[inputs])


# --- two gloo processes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mixed_model(tmp_path_factory.mktemp("tp_mixed"))


def _ids() -> list[int]:
    return torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(7)).tolist()


GREEDY = {"max_new_tokens": 8, "temperature": 0, "ban_eos_token": True}


def test_two_gloo_ranks_match_one_process(mixed_model: Path):
    path = mixed_model
    ids = _ids()
    single = loader.load(path, "kestrel", device="cpu", dtype="float32")
    expected_logits = single.logits(ids)
    expected_text = single.generate(ids[:10], GREEDY)
    single.unload()

    tp = loader.load(path, "kestrel", device="cpu", dtype="float32", tp=2)
    try:
        formats = [
            getattr(getattr(layer.self_attn.o_proj, "inner", None), "format", "dense")
            + "/"
            + getattr(getattr(layer.mlp.down_proj, "inner", None), "format", "dense")
            for layer in tp.engine.model.model.layers
        ]
        assert formats == ["dense/dense", "exl2/gptq", "gptq/exl2"]
        info = tp.info()["placement"]
        assert info["mode"] == "tensor_parallel" and info["tp_world_size"] == 2
        # Tensor parallelism is the engine's runner (it holds the ranks), not an Engine kind.
        from engine.engine import Engine
        from engine.tensor_parallel.runner import TensorParallelRunner

        assert type(tp.engine) is Engine and isinstance(tp.engine.runner, TensorParallelRunner)
        assert info["ranks"] == ["cpu", "cpu"]
        attn = tp.engine.model.model.layers[0].self_attn
        assert attn.spec.num_kv_heads == 1 and attn.spec.num_heads == 2  # half of 2 / 4
        assert tp.engine.cache.k[0].shape[2] == 1  # the cache holds this rank's KV head
        logits = tp.logits(ids)
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(logits.argmax(-1), expected_logits.argmax(-1))
        assert tp.generate(ids[:10], GREEDY) == expected_text
        # Every rank would have to join a forward for hidden states: refused, clearly.
        with pytest.raises(UnsupportedFeatureError, match="tensor parallelism"):
            tp.embed(ids)
    finally:
        tp.unload()


@pytest.mark.parametrize("cache_type", ["fp8", "q4"])
def test_two_gloo_ranks_with_a_quantized_cache_match_one_process(
    mixed_model: Path, cache_type: str
):
    """A quantized cache keeps codes and scales per token and KV head, so each rank's cache
    of its own KV heads holds what one process's cache holds for them. The ranks sum their
    partial products in another order than one process, and a K or V value that close to a
    rounding boundary of the cache type can round the other way, so the logits agree up to
    the cache's own quantization noise (measured here against an unquantized cache), not
    to 1e-4 as with an unquantized cache."""
    ids = _ids()

    def single(kind: str) -> torch.Tensor:
        m = loader.load(mixed_model, "kestrel", device="cpu", dtype="float32", cache_type=kind)
        try:
            return m.logits(ids)
        finally:
            m.unload()

    plain, expected = single("fp16"), single(cache_type)
    noise = float((expected - plain).abs().max())
    assert noise > 1e-3  # the cache type does quantize
    tp = loader.load(
        mixed_model, "kestrel", device="cpu", dtype="float32", tp=2, cache_type=cache_type
    )
    try:
        cache = tp.engine.cache
        assert cache.cache_type == cache_type and cache.k[0].dtype == torch.uint8
        assert cache.k[0].shape[2] == 1  # this rank's KV head, as byte rows
        logits = tp.logits(ids)
        assert float((logits - expected).abs().max()) < 0.5 * noise
        assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    finally:
        tp.unload()


def test_tp_refuses_what_it_cannot_shard(mixed_model: Path):
    with pytest.raises(loader.LoaderError, match="4 query / 2 KV heads do not divide among 3"):
        loader.load(mixed_model, "kestrel", device="cpu", tp=3)
    with pytest.raises(ValueError, match="cannot be combined"):
        loader.load(mixed_model, "kestrel", device="cpu", tp=2, cpu_offload=True)
    with pytest.raises(loader.LoaderError, match="tp=0: expected a whole number 1..1024"):
        loader.load(mixed_model, "kestrel", device="cpu", tp=0)
    with pytest.raises(loader.LoaderError, match="on the CPU needs tp=N"):
        loader.load(mixed_model, "kestrel", device="cpu", tensor_parallel=True)


def test_cli_reports_bad_placement_flags(mixed_model: Path, capsys: pytest.CaptureFixture):
    from loader.__main__ import main

    assert main([str(mixed_model), "--device", "cpu", "--gpu-split", "20,x"]) == 1
    assert "--gpu-split takes GiB per GPU like 20,24; got '20,x'" in capsys.readouterr().err
    assert main([str(mixed_model), "--device", "cpu", "--tp", "3"]) == 1
    assert "do not divide among 3 ranks" in capsys.readouterr().err


@pytest.mark.parametrize("fresh", [True, False])
def test_the_forward_message_carries_every_batch_field(fresh: bool):
    """What rank 0 broadcasts for a forward rebuilds its batch on the other ranks, host
    fields included: `fresh` picks the attention path, so every rank must take the same."""
    from engine.cache import ForwardBatch, PagedKVCache, Sequence
    from engine.tensor_parallel.protocol import HEADER, batch_from, batch_header, batch_payload

    cache = PagedKVCache(
        num_layers=1, num_kv_heads=1, head_dim=8, num_pages=8, page_size=4,
        dtype=torch.float32, layer_devices=[torch.device("cpu")],
    )  # fmt: skip
    seq = Sequence()
    if not fresh:
        ForwardBatch.build(cache, [seq], [[1, 2, 3]])
    batch = ForwardBatch.build(cache, [seq], [[4, 5, 6, 7, 8]])
    assert batch.fresh == fresh
    header = batch_header(batch)
    assert len(header) <= HEADER
    again = batch_from(header + [0] * (HEADER - len(header)), batch_payload(batch))
    for name in ("token_ids", "positions", "slots", "cu_seqlens", "context_lens", "page_table",
                 "logits_indices"):  # fmt: skip
        assert torch.equal(getattr(again, name), getattr(batch, name)), name
    assert (again.max_query_len, again.max_context_len, again.fresh) == (
        batch.max_query_len, batch.max_context_len, fresh,
    )  # fmt: skip


# -- staging: where a rank loads each layer before cutting its shard ---------------------

GPU0 = torch.device("cuda", 0)
CPU = torch.device("cpu")


def _weights(layers: list[int], embed: int = 100, head: int = 100) -> ModelFootprint:
    return ModelFootprint(embed, layers, head, cache_bytes_per_layer=0, activation_bytes=0)


def test_staging_fills_the_gpu_with_whole_layers_in_order():
    fp = _weights([400, 400, 400, 400])
    # Room after the reserve (100), embeddings and head (200) and the largest shard (200):
    # 1000 - 500 = 500 holds one whole layer; 1300 holds two.
    plan = staging_placement(fp, 2, GPU0, free_bytes=1000, reserve_bytes=100)
    assert plan.layer_devices == [GPU0, CPU, CPU, CPU]
    assert plan.embed_device == GPU0 and plan.head_device == GPU0
    plan = staging_placement(fp, 2, GPU0, free_bytes=1300, reserve_bytes=100)
    assert plan.layer_devices == [GPU0, GPU0, CPU, CPU]
    plan = staging_placement(fp, 4, GPU0, free_bytes=2100, reserve_bytes=100)
    assert plan.layer_devices == [GPU0] * 4  # 2100 - 300 - 100 = 1700 >= 1600
    # A small layer after one that went to the CPU stays on the CPU: one GPU run, in order.
    plan = staging_placement(_weights([400, 900, 100]), 2, GPU0, 1300, reserve_bytes=100)
    assert plan.layer_devices == [GPU0, CPU, CPU]


def test_staging_falls_back_to_the_cpu():
    fp = _weights([400, 400])
    # The embeddings, head and largest shard alone do not fit: everything on the CPU.
    plan = staging_placement(fp, 2, GPU0, free_bytes=450, reserve_bytes=100)
    assert plan.devices == [CPU]
    # A CPU rank (gloo) loads on the CPU whatever the numbers say.
    assert staging_placement(fp, 2, CPU, free_bytes=10**12).devices == [CPU]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rank", [0, 1])
def test_shards_cut_on_the_gpu_equal_shards_cut_on_the_cpu(mixed_model: Path, rank: int):
    """A rank that stages layers on its GPU (quantized weights repacked there, groups sliced
    there) keeps exactly the shard a rank cutting everything on the CPU keeps; here layer 0
    is staged on the GPU and layers 1-2 (EXL2 and GPTQ) on the CPU, then the reverse."""
    config = ModelConfig.from_dir(mixed_model)
    n = config.num_hidden_layers

    def shard(placement: Placement) -> nn.Module:
        model = load_causal_lm(
            mixed_model, device=GPU0, dtype=torch.float16, config=config, placement=placement
        )
        shard_model(model, rank=rank, world=2)
        return move_model(model, GPU0)

    expected = shard(Placement.single(CPU, n))
    for layers in ([GPU0, CPU, CPU], [GPU0] * n):
        got = shard(Placement(GPU0, layers, GPU0))
        for (name, a), (_, b) in zip(
            got.named_parameters(), expected.named_parameters(), strict=True
        ):
            assert torch.equal(a, b), name
        quantized = [
            (name, m, dict(expected.named_modules())[name])
            for name, m in got.named_modules()
            if isinstance(m, QuantizedLinear)
        ]
        assert quantized and len(quantized) == sum(
            isinstance(m, QuantizedLinear) for m in expected.modules()
        )
        for name, a, b in quantized:
            assert torch.equal(dequantize_reference(a.qweight), dequantize_reference(b.qweight))
            assert (a.qweight.perm is None) == (b.qweight.perm is None), name
            if a.qweight.perm is not None:
                assert torch.equal(a.qweight.perm, b.qweight.perm), name
