"""Layer-split planning: which device holds the embeddings, each decoder layer (with its
KV cache pages) and the final norm + head. Pure arithmetic over byte counts, so it is
tested without GPUs.

The model is a chain of parts, [embeddings, layer 0, ..., layer L-1, head]; a part's
footprint is its weights plus (for a layer) its share of the paged KV cache. Devices are
filled in order, each part going to the first device (from the current one onwards) with
room for it, so the forward crosses each device boundary once.

- Manual split (`gpu_split`, GiB per GPU): a GPU's budget is exactly that number.
- Auto split: a GPU's budget is its free memory (torch.cuda.mem_get_info) minus the
  activation workspace the engine needs there and the user's reserve.
- Parts that fit no GPU go to the CPU when `cpu_offload` is on (they run on the torch
  path); otherwise planning fails with `PlacementError`, saying how much memory is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GIB = 2**30
CPU = torch.device("cpu")


class PlacementError(ValueError):
    """The model does not fit the devices it was given (or the split is malformed)."""


@dataclass(frozen=True)
class ModelFootprint:
    """Bytes each part of the model needs on its device."""

    embed_bytes: int  # embedding table
    layer_bytes: list[int]  # weights of each decoder layer
    head_bytes: int  # final norm + lm_head (a tied head counts its own copy: see tied_head)
    cache_bytes_per_layer: int  # K and V pages of one layer
    activation_bytes: int  # per-GPU workspace for a prefill chunk (scratch, logits)
    tied_head: bool = False  # lm_head shares the embedding table when both sit on one device

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def total_bytes(self) -> int:
        layers = sum(self.layer_bytes) + self.cache_bytes_per_layer * self.num_layers
        return self.embed_bytes + layers + self.head_bytes


@dataclass
class Placement:
    """Where each part of the model lives (the plan the loader executes)."""

    embed_device: torch.device
    layer_devices: list[torch.device]
    head_device: torch.device
    # Bytes planned per device (weights + cache), for info() and tests.
    planned_bytes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def single(cls, device: torch.device, num_layers: int) -> Placement:
        return cls(device, [device] * num_layers, device)

    @property
    def devices(self) -> list[torch.device]:
        """Devices in forward order, each once."""
        return list(dict.fromkeys([self.embed_device, *self.layer_devices, self.head_device]))

    def device_of(self, param_name: str) -> torch.device:
        """The device of a checkpoint tensor / parameter by its qualified name."""
        if param_name.startswith("model.layers."):
            index = int(param_name.split(".", 3)[2])
            return self.layer_devices[index]
        if param_name.startswith("model.embed_tokens."):
            return self.embed_device
        return self.head_device  # model.norm, lm_head

    def describe(self) -> dict[str, object]:
        """A JSON-friendly summary: layer ranges per device, embeddings, head, GiB planned."""
        ranges: dict[str, list[str]] = {}
        start = 0
        for i in range(1, len(self.layer_devices) + 1):
            if i == len(self.layer_devices) or self.layer_devices[i] != self.layer_devices[start]:
                span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
                ranges.setdefault(str(self.layer_devices[start]), []).append(span)
                start = i
        return {
            "embeddings": str(self.embed_device),
            "layers": {device: ",".join(spans) for device, spans in ranges.items()},
            "head": str(self.head_device),
            "planned_gib": {d: round(b / GIB, 3) for d, b in self.planned_bytes.items()},
        }


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


def plan_placement(
    footprint: ModelFootprint,
    devices: list[torch.device],
    *,
    gpu_split: list[float] | None = None,
    free_bytes: list[int] | None = None,
    reserve_bytes: int = 0,
    cpu_offload: bool = False,
) -> Placement:
    """Plan a layer split over `devices` (GPUs, in fill order).

    The budgets come from `gpu_split` (GiB per device, manual) when given, else from
    `free_bytes` (measured free memory per device: auto split) less the reserve and the
    activation workspace. With both, a manual budget above what is usable is an error.
    """
    if not devices:
        raise PlacementError("no GPU to place the model on")
    if gpu_split is None and free_bytes is None:
        raise PlacementError("give gpu_split (GiB per GPU) or the free memory for an auto split")
    if gpu_split is not None:
        if len(gpu_split) > len(devices):
            raise PlacementError(
                f"gpu_split names {len(gpu_split)} GPUs but only {len(devices)} are available"
            )
        if any(not isinstance(g, (int, float)) or g < 0 for g in gpu_split):
            raise PlacementError(f"gpu_split must be non-negative GiB per GPU, got {gpu_split}")
        devices = devices[: len(gpu_split)]
        budgets = [int(g * GIB) for g in gpu_split]
        if free_bytes is not None:
            for device, budget, free in zip(devices, budgets, free_bytes, strict=False):
                room = free - reserve_bytes - footprint.activation_bytes
                if budget > room:
                    raise PlacementError(
                        f"gpu_split gives {device} {_gib(budget)}, but only {_gib(max(room, 0))} "
                        f"is usable there ({_gib(free)} free, minus {_gib(reserve_bytes)} "
                        f"reserve and {_gib(footprint.activation_bytes)} for activations)"
                    )
    else:
        assert free_bytes is not None
        if len(free_bytes) != len(devices):
            raise PlacementError(f"{len(free_bytes)} free-memory figures for {len(devices)} GPUs")
        budgets = [max(0, f - reserve_bytes - footprint.activation_bytes) for f in free_bytes]

    fp = footprint
    parts = [fp.embed_bytes, *(b + fp.cache_bytes_per_layer for b in fp.layer_bytes)]
    used = [0] * len(devices)
    where: list[torch.device] = []
    current = 0
    for index in range(len(parts) + 1):
        while current < len(devices):
            size = _part_bytes(fp, parts, index, devices[current], where)
            if used[current] + size <= budgets[current]:
                break
            current += 1
        if current == len(devices):
            if not cpu_offload:
                _raise_not_fit(
                    fp, devices, budgets, used, index, _part_bytes(fp, parts, index, CPU, where)
                )
            where.extend([CPU] * (len(parts) + 1 - index))
            break
        used[current] += size
        where.append(devices[current])
    planned = {str(d): used[i] for i, d in enumerate(devices) if used[i]}
    if CPU in where:
        planned[str(CPU)] = sum(
            _part_bytes(fp, parts, i, CPU, where[:i]) for i, d in enumerate(where) if d == CPU
        )
    return Placement(where[0], where[1:-1], where[-1], planned)


def _part_bytes(
    fp: ModelFootprint,
    parts: list[int],
    index: int,
    device: torch.device,
    placed: list[torch.device],
) -> int:
    """Bytes of part `index` ([embeddings, layers..., head]) if it goes on `device`: a tied
    head needs its own copy of the embedding table unless it sits beside the embeddings."""
    if index < len(parts):
        return parts[index]
    if fp.tied_head and not (placed and placed[0] == device):
        return fp.head_bytes + fp.embed_bytes
    return fp.head_bytes


def _raise_not_fit(
    fp: ModelFootprint,
    devices: list[torch.device],
    budgets: list[int],
    used: list[int],
    placed_parts: int,
    next_part_bytes: int,
) -> None:
    """The model does not fit: say what is left over and how many GiB are missing."""
    if placed_parts == 0:
        what = "the embeddings, every layer and the head"
    elif placed_parts <= fp.num_layers:
        what = f"layers {placed_parts - 1}-{fp.num_layers - 1} and the head"
    else:
        what = "the final norm and head"
    total_budget = sum(budgets)
    # The shortfall over all budgets; when whole layers leave unusable ends on each GPU,
    # at least the room the next part lacks on the last one.
    missing = max(fp.total_bytes - total_budget, next_part_bytes - (budgets[-1] - used[-1]))
    names = ", ".join(f"{d} {_gib(b)}" for d, b in zip(devices, budgets, strict=True))
    raise PlacementError(
        f"the model does not fit: it needs {_gib(fp.total_bytes)} (weights + KV cache) and the "
        f"GPUs offer {_gib(total_budget)} ({names}); no room is left for {what}: "
        f"{_gib(missing)} more GPU memory is missing. Shorten max_seq_len / cache_tokens, "
        "add GPUs, lower the reserve, or enable cpu_offload."
    )


def check_single_device_fit(fp: ModelFootprint, device: torch.device, free_bytes: int) -> None:
    """A model loaded whole onto one GPU: refuse it before any weight moves when its
    weights and KV cache exceed the GPU's free memory, saying how much is missing
    (otherwise the load dies halfway with CUDA's out-of-memory error). The prefill
    workspace is left out on purpose: the estimate must never refuse a model that fits."""
    need = fp.total_bytes
    if need <= free_bytes:
        return
    raise PlacementError(
        f"the model does not fit on {device}: it needs {_gib(need)} (weights + KV cache) and "
        f"{_gib(free_bytes)} is free; {_gib(need - free_bytes)} more GPU memory is missing. "
        "Shorten max_seq_len / cache_tokens, use a quantized cache (cache_type) or fewer "
        "bits per weight, or spread the model with gpu_split / autosplit (and cpu_offload)."
    )
