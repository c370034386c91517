"""Layer-split planning without GPUs: manual split, auto split from free memory with a
reserve, CPU offload, the not-fit error and its missing amount; the footprint read from a
checkpoint equals what loading puts in memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import loader
from engine.cache import PagedKVCache
from engine.config import ModelConfig
from engine.loading import load_causal_lm
from engine.placement import GIB, ModelFootprint, Placement, PlacementError, plan_placement
from engine.placement.footprint import model_footprint
from engine.quantized_linear import QuantizedLinear
from engine.weights import WeightStore
from kernels.quant_matmul.layout import stored_bytes

from model_factory import make_tiny_llama

GPU = [torch.device("cuda", i) for i in range(3)]
CPU = torch.device("cpu")


def _footprint(layers: int = 10, *, tied: bool = False, act: float = 0.0) -> ModelFootprint:
    return ModelFootprint(
        embed_bytes=1 * GIB,
        layer_bytes=[GIB] * layers,
        head_bytes=GIB // 2 if tied else GIB,
        cache_bytes_per_layer=GIB // 10,
        activation_bytes=int(act * GIB),
        tied_head=tied,
    )


def _check_invariants(fp: ModelFootprint, plan: Placement, budgets: dict[str, float]) -> None:
    order = [plan.embed_device, *plan.layer_devices, plan.head_device]
    # Devices are visited in order and never revisited: one crossing per boundary.
    seen = list(dict.fromkeys(order))
    assert order == sorted(order, key=seen.index)
    for device, planned in plan.planned_bytes.items():
        if device != "cpu":
            assert planned <= budgets[device] * GIB
    assert sum(plan.planned_bytes.values()) >= fp.total_bytes


def test_manual_split_fills_devices_in_order():
    fp = _footprint()
    plan = plan_placement(fp, GPU[:2], gpu_split=[6, 8])
    # cuda:0: embeddings (1) + 4 layers of 1.1 = 5.4 <= 6; a 5th would need 6.5.
    assert plan.embed_device == GPU[0]
    assert plan.layer_devices == [GPU[0]] * 4 + [GPU[1]] * 6
    assert plan.head_device == GPU[1]
    _check_invariants(fp, plan, {"cuda:0": 6, "cuda:1": 8})
    assert plan.describe()["layers"] == {"cuda:0": "0-3", "cuda:1": "4-9"}


def test_manual_split_can_skip_a_device_and_rejects_bad_values():
    fp = _footprint(4)
    plan = plan_placement(fp, GPU, gpu_split=[0, 3, 5])
    assert plan.embed_device == GPU[1] and GPU[0] not in plan.devices
    with pytest.raises(PlacementError, match="non-negative"):
        plan_placement(fp, GPU, gpu_split=[-1, 8])
    with pytest.raises(PlacementError, match="names 4 GPUs but only 3"):
        plan_placement(fp, GPU, gpu_split=[4, 4, 4, 4])


def test_manual_split_above_free_memory_is_an_error():
    fp = _footprint(act=0.5)
    with pytest.raises(PlacementError, match=r"gpu_split gives cuda:1 9\.00 GiB.*7\.25 GiB"):
        plan_placement(
            fp, GPU[:2], gpu_split=[6, 9], free_bytes=[20 * GIB, 8 * GIB], reserve_bytes=GIB // 4
        )


def test_autosplit_leaves_reserve_and_activations_free():
    fp = _footprint(act=0.5)
    free = [7 * GIB, 20 * GIB]
    plan = plan_placement(fp, GPU[:2], free_bytes=free, reserve_bytes=GIB)
    # cuda:0 budget 7 - 1 - 0.5 = 5.5: embeddings + 4 layers (5.4).
    assert plan.layer_devices.count(GPU[0]) == 4
    _check_invariants(fp, plan, {"cuda:0": 5.5, "cuda:1": 18.5})
    # A larger reserve pushes a layer to the next GPU.
    plan2 = plan_placement(fp, GPU[:2], free_bytes=free, reserve_bytes=int(1.2 * GIB))
    assert plan2.layer_devices.count(GPU[0]) == 3


def test_offload_puts_what_does_not_fit_on_the_cpu():
    fp = _footprint()
    plan = plan_placement(fp, GPU[:2], gpu_split=[4, 4], cpu_offload=True)
    # 1 + 2*1.1 on cuda:0 (3 layers would be 4.3), 3 layers on cuda:1 (3.3), the rest on CPU.
    assert plan.layer_devices == [GPU[0]] * 2 + [GPU[1]] * 3 + [CPU] * 5
    assert plan.head_device == CPU
    assert plan.planned_bytes["cpu"] == 5 * (GIB + GIB // 10) + GIB


def test_not_fit_error_says_how_much_is_missing():
    fp = _footprint()
    total = fp.total_bytes
    with pytest.raises(PlacementError) as info:
        plan_placement(fp, GPU[:2], gpu_split=[4, 4])
    message = str(info.value)
    assert f"{(total - 8 * GIB) / GIB:.2f} GiB more GPU memory is missing" in message
    assert "no room is left for layers 5-9 and the head" in message
    assert "cpu_offload" in message


def test_not_fit_by_fragmentation_reports_the_next_part():
    # The budgets (4.5 GiB) exceed the total (4.2), but each GPU holds only one part.
    fp = _footprint(2)
    with pytest.raises(PlacementError) as info:
        plan_placement(fp, GPU[:3], gpu_split=[1.5, 1.5, 1.5])
    # The head (1 GiB) finds 1.5 - 1.1 = 0.4 GiB on the last GPU: 0.6 GiB short, although
    # the budgets (4.5) exceed the total (4.2).
    assert fp.total_bytes < 4.5 * GIB
    assert "0.60 GiB more GPU memory is missing" in str(info.value)


def test_tied_head_needs_a_copy_of_the_embeddings_on_another_device():
    fp = _footprint(2, tied=True)
    same = plan_placement(fp, GPU[:1], gpu_split=[10])
    assert same.planned_bytes["cuda:0"] == fp.total_bytes
    split = plan_placement(fp, GPU[:2], gpu_split=[2.2, 10])
    assert split.embed_device == GPU[0] and split.head_device == GPU[1]
    # layer 1, the head's own weights and its copy of the embedding table
    assert split.planned_bytes["cuda:1"] == (GIB + GIB // 10) + GIB // 2 + GIB


def test_device_of_maps_checkpoint_names():
    plan = Placement(GPU[0], [GPU[0], GPU[1]], GPU[1])
    assert plan.device_of("model.embed_tokens.weight") == GPU[0]
    assert plan.device_of("model.layers.1.mlp.down_proj.qweight") == GPU[1]
    assert plan.device_of("model.norm.weight") == GPU[1]
    assert plan.device_of("lm_head.weight") == GPU[1]
    assert plan.devices == [GPU[0], GPU[1]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_llama(path, num_hidden_layers=3)
    return path


def _loaded_bytes(module: torch.nn.Module) -> int:
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    for m in module.modules():
        if isinstance(m, QuantizedLinear):
            qw = m.qweight
            tensors = [qw.scales, qw.zeros, qw.row_group, qw.perm, qw.bias]
            tensors += [p.packed for s in qw.segments for p in s.planes]
            total += sum(stored_bytes(t) for t in tensors if t is not None)
    return total


def test_footprint_of_a_dense_checkpoint_equals_loaded_bytes(tiny: Path):
    config = ModelConfig.from_dir(tiny)
    fp = model_footprint(
        WeightStore(tiny),
        config,
        dtype=torch.float32,
        cache_tokens=300,
        page_size=64,
        prefill_chunk=128,
    )
    model = load_causal_lm(tiny, device=CPU, dtype=torch.float32, config=config)
    layers = model.model.layers
    assert fp.layer_bytes == [_loaded_bytes(layer) for layer in layers]
    assert fp.embed_bytes == _loaded_bytes(model.model.embed_tokens)
    assert fp.head_bytes == _loaded_bytes(model.lm_head) + _loaded_bytes(model.model.norm)
    # 300 tokens -> 5 pages + the decode graphs' scratch slot, K and V, fp32: what the
    # cache allocates for a layer.
    assert fp.cache_bytes_per_layer == 2 * (5 * 64 + 1) * config.num_key_value_heads * 16 * 4
    cache = PagedKVCache(
        num_layers=1,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        num_pages=5,
        page_size=64,
        dtype=torch.float32,
        layer_devices=[CPU],
    )
    assert fp.cache_bytes_per_layer == cache.k_slots[0].nbytes + cache.v_slots[0].nbytes


def test_footprint_of_exl2_and_gptq_layers_equals_loaded_bytes(tiny: Path, tmp_path: Path):
    from test_tensor_parallel import _mixed_quantize, quantize_checkpoint

    # layer 0 dense, layer 1 EXL2 attention + GPTQ act-order MLP, layer 2 the reverse
    quantize_checkpoint(tiny, tmp_path / "q", _mixed_quantize)
    cfg_path = tmp_path / "q" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    cfg_path.write_text(json.dumps(cfg))
    config = ModelConfig.from_dir(tmp_path / "q")
    fp = model_footprint(
        WeightStore(tmp_path / "q"),
        config,
        dtype=torch.float32,
        cache_tokens=64,
        page_size=64,
        prefill_chunk=64,
    )
    model = load_causal_lm(tmp_path / "q", device=CPU, dtype=torch.float32, config=config)
    assert fp.layer_bytes == [_loaded_bytes(layer) for layer in model.model.layers]


def test_split_options_without_gpus_fail_clearly(tiny: Path):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU message")
    with pytest.raises(loader.LoaderError, match="need CUDA GPUs"):
        loader.load(tiny, "kestrel", autosplit=True)
    with pytest.raises(loader.LoaderError, match="cpu_offload needs gpu_split or autosplit"):
        loader.load(tiny, "kestrel", device="cpu", cpu_offload=True)


def test_single_device_info_shows_the_placement(tiny: Path):
    m = loader.load(tiny, "kestrel", device="cpu")
    placement = m.info()["placement"]
    assert placement["layers"] == {"cpu": "0-2"}
    assert placement["mode"] == "single" and placement["tp_world_size"] == 1
    m.unload()


def test_single_gpu_load_that_does_not_fit_says_how_much_is_missing():
    from engine.placement import check_single_device_fit

    fp = _footprint()  # 12 GiB of weights and 1 GiB of cache
    check_single_device_fit(fp, GPU[0], fp.total_bytes)  # exactly enough: loads
    with pytest.raises(PlacementError) as info:
        check_single_device_fit(fp, GPU[0], 10 * GIB)
    message = str(info.value)
    assert "does not fit on cuda:0" in message
    assert f"{(fp.total_bytes - 10 * GIB) / GIB:.2f} GiB more GPU memory is missing" in message
    assert "cache_type" in message and "gpu_split" in message


@pytest.mark.parametrize("cache_type", ["fp16", "q4"])
def test_footprint_of_every_architecture_counts_its_weights(tmp_path: Path, cache_type: str):
    """Every CUDA load now reads the footprint first: it must work for every architecture,
    count all the weights once and size the cache by its storage type."""
    from test_architectures import CASES

    from engine.cache import cache_bytes_per_token

    from model_factory import make_tiny_model

    for case, (config_cls, overrides, _) in CASES.items():
        path = tmp_path / case
        hf = make_tiny_model(path, config_cls, **overrides)
        config = ModelConfig.from_dir(path)
        per_token = cache_bytes_per_token(
            cache_type, num_layers=1, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, dtype=torch.float16,
        )  # fmt: skip
        fp = model_footprint(
            WeightStore(path), config, dtype=torch.float16, cache_tokens=64, page_size=16,
            prefill_chunk=32, cache_token_bytes=per_token,
        )  # fmt: skip
        weights = fp.total_bytes - fp.cache_bytes_per_layer * fp.num_layers
        stored = {n: p for n, p in hf.state_dict().items()}
        tied = [n for n in stored if n.startswith("lm_head.")] if fp.tied_head else []
        want = sum(p.numel() * 2 for n, p in stored.items() if n not in tied)
        assert weights == want, case
        assert fp.cache_bytes_per_layer == (64 + 1) * per_token, case  # + the scratch slot
