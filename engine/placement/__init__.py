"""Placement: where the parts of a model live (layer split, CPU offload) and how it is
sharded (tensor parallel, engine/tensor_parallel/).

A placement is a transform applied after the model is built on the meta device and before
weights are read: layers never learn how many devices there are. `plan.py` is the pure
arithmetic, `footprint.py` reads byte counts from the checkpoint, and `choose_placement`
ties them to the devices of this machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.placement.plan import (
    GIB,
    ModelFootprint,
    Placement,
    PlacementError,
    check_single_device_fit,
    plan_placement,
)

__all__ = [
    "GIB",
    "ModelFootprint",
    "Placement",
    "PlacementError",
    "PlacementOptions",
    "choose_placement",
    "plan_placement",
]


@dataclass(frozen=True)
class PlacementOptions:
    gpu_split: list[float] | None = None  # GiB per GPU, in order (manual layer split)
    autosplit: bool = False  # fill GPUs in order from their measured free memory
    gpu_reserve_gb: float = 0.25  # GiB left free on every GPU (auto split)
    cpu_offload: bool = False  # layers that fit no GPU run on the CPU (slow)

    @property
    def splits(self) -> bool:
        return bool(self.gpu_split) or self.autosplit


def free_gpu_bytes(devices: list[torch.device]) -> list[int]:
    """Free memory per GPU as the driver reports it (other processes' use included)."""
    return [torch.cuda.mem_get_info(d)[0] for d in devices]


def choose_placement(
    footprint: ModelFootprint,
    options: PlacementOptions,
    *,
    default_device: torch.device,
) -> Placement:
    """The plan for this machine: everything on `default_device` unless a split (or
    offload) is asked for; then the visible GPUs in index order."""
    if not options.splits:
        if options.cpu_offload:
            raise PlacementError("cpu_offload needs gpu_split or autosplit to say what fits")
        return Placement.single(default_device, footprint.num_layers)
    if not torch.cuda.is_available():
        raise PlacementError("gpu_split / autosplit need CUDA GPUs; none is available")
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if options.gpu_split:
        devices = devices[: len(options.gpu_split)]
    free = free_gpu_bytes(devices)
    reserve = int(options.gpu_reserve_gb * GIB)
    return plan_placement(
        footprint,
        devices,
        gpu_split=list(options.gpu_split) if options.gpu_split else None,
        free_bytes=free,
        reserve_bytes=reserve,
        cpu_offload=options.cpu_offload,
    )


def plan_for_model(
    model_dir: str,
    config: object,
    options: PlacementOptions,
    *,
    device: torch.device,
    dtype: torch.dtype,
    cache_tokens: int,
    page_size: int,
    prefill_chunk: int,
    cache_token_bytes: int | None = None,
) -> Placement:
    """Read the checkpoint's footprint (headers only) and choose the placement. A model
    loaded whole onto one GPU is checked against that GPU's free memory first."""
    from engine.config import ModelConfig
    from engine.placement.footprint import model_footprint
    from engine.weights import WeightStore

    assert isinstance(config, ModelConfig)
    single = not options.splits and not options.cpu_offload
    if single and device.type != "cuda":
        return Placement.single(device, config.num_hidden_layers)
    footprint = model_footprint(
        WeightStore(model_dir),
        config,
        dtype=dtype,
        cache_tokens=cache_tokens,
        page_size=page_size,
        prefill_chunk=prefill_chunk,
        cache_token_bytes=cache_token_bytes,
    )
    if single:
        check_single_device_fit(footprint, device, free_gpu_bytes([device])[0])
        return Placement.single(device, config.num_hidden_layers)
    return choose_placement(footprint, options, default_device=device)
