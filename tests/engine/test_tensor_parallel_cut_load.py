"""A tensor-parallel rank reads only its part of the weights (engine/tensor_parallel/cut_load.py)
and keeps exactly the shard that loading everything and cutting it (transform.shard_model)
keeps: every tensor equal, dtype included. On real safetensors files: the mixed tiny Llama
(FP16, EXL2 with act-order and mixed bits, GPTQ with act-order, on both axes) and an
all-GPTQ model without act-order (as the 70B bench builds it: quantized head, FP16
embeddings), whose ranks each read about half of the file's bytes, counted at the store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.config import ModelConfig
from engine.loading import load_causal_lm
from engine.placement import Placement
from engine.quantized_linear import QuantizedLinear
from engine.tensor_parallel.rank import load_rank_shard
from engine.tensor_parallel.transform import shard_model
from engine.weights import WeightStore
from helpers.mixed_model import build_mixed_model, quantize_checkpoint
from helpers.model_factory import make_tiny_llama
from helpers.quantized import gptq_quantize

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mixed_model(tmp_path_factory.mktemp("cut_mixed"))


@pytest.fixture(scope="module")
def gptq_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPTQ 4-bit, group 32, no act-order, every linear and the head; embeddings FP16."""
    root = tmp_path_factory.mktemp("cut_gptq")
    make_tiny_llama(
        root / "fp16",
        dtype=torch.float16,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    path = quantize_checkpoint(root / "fp16", root / "q", gptq_quantize(4, 32, True, False, False))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _cut_after_load(path: Path, rank: int) -> nn.Module:
    config = ModelConfig.from_dir(path)
    model = load_causal_lm(path, device=CPU, dtype=torch.float32, config=config)
    return shard_model(model, rank=rank, world=2)


def _cut_while_loading(path: Path, rank: int, store: WeightStore | None = None) -> nn.Module:
    config = ModelConfig.from_dir(path)
    return load_rank_shard(
        str(path),
        rank=rank,
        world=2,
        device=CPU,
        dtype=torch.float32,
        config=config,
        placement=Placement.single(CPU, config.num_hidden_layers),
        store=store,
    )


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model holds: parameters, and each quantized weight's parts."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            qw = module.qweight
            out[f"{name}.scales"] = qw.scales
            out[f"{name}.zeros"] = qw.zeros
            out[f"{name}.row_group"] = qw.row_group
            for key, t in (("perm", qw.perm), ("bias", qw.bias)):
                if t is not None:
                    out[f"{name}.{key}"] = t
            for i, seg in enumerate(qw.segments):
                for j, plane in enumerate(seg.planes):
                    out[f"{name}.seg{i}.{seg.bits}b.{seg.row_start}-{seg.row_end}.p{j}"] = (
                        plane.packed
                    )
            out[f"{name}.features"] = torch.tensor(
                [qw.in_features, qw.out_features, module.in_features, module.out_features]
            )
    return out


def _assert_same_shard(got: nn.Module, expected: nn.Module) -> None:
    a, b = _tensors(got), _tensors(expected)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name
    kinds = [(n, type(m).__name__) for n, m in got.named_modules()]
    assert kinds == [(n, type(m).__name__) for n, m in expected.named_modules()]
    for (name, m), (_, e) in zip(got.named_modules(), expected.named_modules(), strict=True):
        for attr in ("in_features", "out_features", "lo", "per_rank", "vocab"):
            assert getattr(m, attr, None) == getattr(e, attr, None), f"{name}.{attr}"
        if hasattr(e, "spec"):
            assert m.spec == e.spec, name

    def tied(model: nn.Module) -> bool:
        return getattr(model.lm_head.inner, "weight", None) is model.model.embed_tokens.weight

    assert tied(got) == tied(expected)


@pytest.mark.parametrize("rank", [0, 1])
def test_mixed_formats_cut_while_loading_equal_cut_after(mixed_model: Path, rank: int):
    _assert_same_shard(_cut_while_loading(mixed_model, rank), _cut_after_load(mixed_model, rank))


@pytest.mark.parametrize("rank", [0, 1])
def test_gptq_cut_while_loading_equals_cut_after(gptq_model: Path, rank: int):
    _assert_same_shard(_cut_while_loading(gptq_model, rank), _cut_after_load(gptq_model, rank))


def _expected_reads(path: Path) -> tuple[int, int]:
    """(all tensor bytes, what one rank reads). Every rank reads whole the norms and each
    GPTQ g_idx (k int32: from it a rank tells which rows are its own), the build plan reads
    q/k/v's and gate/up's g_idx once more (can they run as one linear?), and the rest splits
    in two exactly here: each split falls on whole words and groups."""
    store = WeightStore(path)
    total = whole = extra = 0
    for name in store.names():
        info = store.info(name)
        size = info.dtype.itemsize * int(torch.tensor(info.shape).prod())
        total += size
        if name.endswith(("norm.weight", ".g_idx")):
            whole += size
        if name.endswith(".g_idx") and not name.startswith("lm_head"):
            extra += 0 if name.endswith(("o_proj.g_idx", "down_proj.g_idx")) else size
    assert (total - whole) % 2 == 0
    return total, whole + extra + (total - whole) // 2


def test_each_rank_reads_its_share_of_the_file(gptq_model: Path):
    total, share = _expected_reads(gptq_model)
    for rank in (0, 1):
        store = WeightStore(gptq_model)
        _cut_while_loading(gptq_model, rank, store)
        assert store.bytes_read == share, f"rank {rank}: {store.bytes_read} of {total} bytes"
    assert share < 0.55 * total
    # Reading everything and cutting after reads the whole file on every rank.
    whole = WeightStore(gptq_model)
    load_causal_lm(gptq_model, device=CPU, dtype=torch.float32, store=whole)
    assert whole.bytes_read >= total


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rank", [0, 1])
def test_cut_on_the_gpu_equals_cut_on_the_cpu(mixed_model: Path, rank: int):
    """A rank repacking its pieces on its GPU keeps the shard a CPU rank keeps."""
    from engine.tensor_parallel.transform import move_model

    config = ModelConfig.from_dir(mixed_model)
    gpu = torch.device("cuda", 0)
    got = load_rank_shard(
        str(mixed_model),
        rank=rank,
        world=2,
        device=gpu,
        dtype=torch.float32,
        config=config,
        placement=Placement.single(gpu, config.num_hidden_layers),
    )
    _assert_same_shard(move_model(got, CPU), _cut_after_load(mixed_model, rank))
