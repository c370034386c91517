"""Load flow: model directory -> config -> architecture -> weights on devices.

The model is built on the meta device from a build plan (engine/build_plan.py), then each
parameter is read from the safetensors store straight onto its layer's device in the target
dtype (gpt-fast's pattern): no second copy of the model in host memory, and a shape
mismatch is reported per tensor by name.

A linear that the plan built as one from several stored ones (q/k/v as `qkv_proj`, gate/up
as `gate_up_proj`) is named with its parts in its module's `load_sources`; the load reads
the parts and concatenates them as it goes (`_fused_parts`), dense or quantized, so the
parts never exist as modules.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from engine.architectures import ARCHITECTURES, CausalLM, architecture_class
from engine.build_plan import plan_build
from engine.config import ModelConfig
from engine.placement.plan import Placement
from engine.read_ahead import read_ahead
from engine.weights import WeightError, WeightStore

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def auto_dtype(device: torch.device, *, overflows_float16: bool = False) -> torch.dtype:
    """The dtype a model runs in unless asked: float32 on the CPU (CPU half matmuls are
    slow); on a GPU float16, or bfloat16 for a model whose activations leave float16's
    range (CausalLM.overflows_float16), or float32 where the GPU has no native bfloat16
    (before compute capability 8.0)."""
    if device.type != "cuda":
        return torch.float32
    if not overflows_float16:
        return torch.float16
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.bfloat16 if torch.cuda.get_device_capability(index)[0] >= 8 else torch.float32


def overflows_float16(architecture: str) -> bool:
    """Whether the model class of `architecture` (a config.json "architectures" name)
    leaves float16's range; False for a name Kestrel does not run (its load reports it)."""
    cls = ARCHITECTURES.get(architecture)
    return cls is not None and cls.overflows_float16


def resolve_dtype(
    dtype: str | torch.dtype | None,
    device: torch.device,
    *,
    overflows_float16: bool = False,
) -> torch.dtype:
    """None or "auto": `auto_dtype`. float16 asked for a model that `overflows_float16` is
    given, with a warning that its outputs may be NaN."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype is None or dtype == "auto":
        resolved = auto_dtype(device, overflows_float16=overflows_float16)
    elif dtype in DTYPES:
        resolved = DTYPES[dtype]
    else:
        raise ValueError(f"dtype '{dtype}' is not supported (use float16, bfloat16 or float32)")
    if resolved not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype {resolved} is not supported (use float16, bfloat16 or float32)")
    if resolved == torch.float16 and overflows_float16:
        log.warning(
            "dtype float16: this model's activations exceed float16's range and its outputs "
            "may be NaN (empty replies); use bfloat16 (or leave dtype on auto)"
        )
    return resolved


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:  # torch's message lists a dozen device types Kestrel does not run
        raise ValueError(f"device '{device}' is not supported (use cpu or cuda[:N])") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device '{device}' asked for, but no CUDA GPU is available")
        index = resolved.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device '{device}' asked for, but only {torch.cuda.device_count()} GPU(s) exist"
            )
        resolved = torch.device("cuda", index)
    elif resolved.type != "cpu":
        raise ValueError(f"device '{device}' is not supported (use cpu or cuda[:N])")
    return resolved


class WeightCuts(Protocol):
    """The parts of the stored linears that one tensor-parallel rank keeps: the load reads
    only those (engine/tensor_parallel/cut_load.py). Names are the stored linears' (a fused
    linear's parts, each)."""

    def prepare(self, model: nn.Module, store: WeightStore) -> None:
        """Decide the parts, from `model` (built on the meta device) and the store's small
        tensors, before any weight is read."""

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
        """Read this rank's part of quantized linear `name` now and return what repacks and
        cuts it when called (on the load's thread: it reads the next linear meanwhile), or
        None: the whole linear."""

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
        """This rank's part of tensor `linear`.`leaf` (stored with `shape`), or None: the
        whole tensor."""


# What a load reports as it goes: the fraction done (0..1) and what it is doing.
LoadProgress = Callable[[float, str], None]
# The share of a quantized model's weight loading that its quantized linears take.
QUANTIZED_SHARE = 0.8


def load_causal_lm(
    model_dir: str | Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    config: ModelConfig | None = None,
    progress: LoadProgress | None = None,
    placement: Placement | None = None,
    fuse_projections: bool = True,
    fuse_kernels: bool = True,
    cuts: WeightCuts | None = None,
    store: WeightStore | None = None,
) -> CausalLM:
    """`placement` (engine/placement/) puts each layer on its own device; without it,
    everything goes on `device`. `fuse_projections` / `fuse_kernels`: the build plan's
    fusions (engine/build_plan.py). `progress(fraction, what)` hears how far the weights
    are: quantized linears (read, checked, repacked: most of an EXL2/GPTQ load) take the
    first QUANTIZED_SHARE of it, the other tensors the rest. `cuts`: read only a
    tensor-parallel rank's parts of the linears, embeddings and head. `store`: the
    WeightStore of `model_dir` to read from (it counts the bytes read)."""
    config = config or ModelConfig.from_dir(model_dir)
    cls = architecture_class(config.architecture, source=config.source)
    store = store or WeightStore(model_dir)
    check_layer_count(config, store)
    plan = plan_build(store, fuse_projections=fuse_projections, fuse_kernels=fuse_kernels)
    with torch.device("meta"):
        model = cls(config, tensor_names=set(store.names()), plan=plan)
    placement = placement or Placement.single(device, config.num_hidden_layers)
    model.layer_devices = list(placement.layer_devices)
    sources = _fused_parts(model)
    if cuts is not None:
        cuts.prepare(model, store)
    quantized = _load_quantized_linears(
        model, store, config, placement.device_of, progress, sources, cuts
    )
    start = QUANTIZED_SHARE if quantized else 0.0

    params = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    # A quantized head (EXL2 always writes one) wins over tying it to the embeddings.
    tied = config.tie_word_embeddings and "lm_head" not in quantized
    for i, (name, param) in enumerate(params):
        if tied and name == "lm_head.weight":
            continue
        linear, _, leaf = name.rpartition(".")
        if linear in sources:
            tensor = _read_fused(
                store, sources[linear], leaf, param, dtype, placement.device_of(name), cuts
            )
            _set_parameter(model, name, tensor)
            continue
        if cuts is not None and name in store:
            part = cuts.dense(
                store,
                linear,
                leaf,
                dtype=dtype,
                device=placement.device_of(name),
                shape=tuple(param.shape),
            )
            if part is not None:
                _set_parameter(model, name, part)
                continue
        if name not in store:
            if name == "lm_head.weight":
                raise WeightError(
                    f"tensor 'lm_head.weight' not found in {model_dir} and the config does "
                    "not tie it to the embeddings (tie_word_embeddings is false)"
                )
            raise WeightError(f"tensor '{name}' not found in {model_dir}")
        tensor = _read_dense(store, name, tuple(param.shape), dtype, placement.device_of(name))
        _set_parameter(model, name, tensor)
        if progress:
            progress(start + (1 - start) * (i + 1) / len(params), f"weights {i + 1}/{len(params)}")
    if tied:
        embed = model.embed_weight
        head_device = placement.head_device
        # A head on another device than the embeddings gets its own copy of the table.
        model.lm_head.weight = (
            embed
            if embed.device == head_device
            else nn.Parameter(embed.to(head_device), requires_grad=False)
        )
    store.close()
    model.eval()
    return model


# Per-head norms of q and k (Qwen3, Gemma 3): one weight over head_dim, shared by every
# head. exllamav2 repeats it per head when it loads the model, and its converter saves what
# it loaded, so its EXL2 files hold these as [heads, head_dim].
_HEAD_NORM = re.compile(r"\.self_attn\.[qk]_norm\.weight$")


def _read_dense(
    store: WeightStore,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """One unsplit tensor; a head norm stored once per head is read as the one weight that
    all heads share (and refused, by name, if the heads' rows differ)."""
    stored = store.info(name).shape
    if not (_HEAD_NORM.search(name) and len(shape) == 1 and stored[1:] == shape):
        return store.get(name, dtype=dtype, device=device, shape=shape)
    rows = store.get(name, dtype=dtype, device=device, shape=stored)
    if not bool((rows == rows[:1]).all()):
        raise WeightError(
            f"tensor '{name}' in {store.info(name).file.name} has a different norm weight "
            f"for each of its {stored[0]} heads; this architecture shares one across heads"
        )
    return rows[0].contiguous()


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layer_count(config: ModelConfig, store: WeightStore) -> None:
    """A config that counts more layers than the weights hold is refused up front (before
    the model is built), naming both numbers, rather than as a missing tensor."""
    indices = [int(m[1]) for n in store.names() if (m := _LAYER_INDEX.search(n))]
    held = max(indices) + 1 if indices else 0
    if config.num_hidden_layers > held:
        raise WeightError(
            f"{config.source}: num_hidden_layers is {config.num_hidden_layers}, but the weights "
            f"in {store.model_dir} hold {held} layer(s)"
        )


# A fused linear's parts in the checkpoint: (name, output width) each, in output order.
FusedParts = tuple[tuple[str, int], ...]


def _fused_parts(model: nn.Module) -> dict[str, FusedParts]:
    """{fused linear's name: its parts}, from the modules' `load_sources` (the linears the
    build plan built as one)."""
    parts: dict[str, FusedParts] = {}
    for name, module in model.named_modules():
        sources: dict[str, FusedParts] = getattr(module, "load_sources", {})
        for fused, leaves in sources.items():
            parts[f"{name}.{fused}"] = tuple((f"{name}.{leaf}", w) for leaf, w in leaves)
    return parts


def _read_fused(
    store: WeightStore,
    parts: FusedParts,
    leaf: str,
    param: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    cuts: WeightCuts | None = None,
) -> torch.Tensor:
    """A dense fused linear's `leaf` (weight or bias): its parts' tensors (or a rank's parts
    of them: `cuts`) stacked along the output dimension, each checked against its own shape
    (errors name the part)."""
    rest = tuple(param.shape[1:])
    tensors = []
    for part, width in parts:
        shape = (width, *rest)
        cut = None
        if cuts is not None:
            cut = cuts.dense(store, part, leaf, dtype=dtype, device=device, shape=shape)
        if cut is None:
            cut = store.get(f"{part}.{leaf}", dtype=dtype, device=device, shape=shape)
        tensors.append(cut)
    return torch.cat(tensors, 0)


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


def _load_quantized_linears(
    model: nn.Module,
    store: WeightStore,
    config: ModelConfig,
    device_of: Callable[[str], torch.device],
    progress: LoadProgress | None,
    sources: dict[str, FusedParts],
    cuts: WeightCuts | None = None,
) -> set[str]:
    """Swap every Linear stored as EXL2/GPTQ for a QuantizedLinear; returns their names.
    A fused linear (`sources`) is its parts loaded one by one and concatenated."""
    from engine.fusion import concat_linears
    from engine.modules import Linear
    from engine.quantized_linear import linear_format, read_quantized_linear

    def read(name: str, in_features: int, out_features: int) -> Callable[[], nn.Module]:
        if cuts is not None:
            build = cuts.read_quantized(
                store,
                name,
                in_features=in_features,
                out_features=out_features,
                device=device_of(name),
                quantization_config=config.quantization_config,
            )
            if build is not None:
                return build
        return read_quantized_linear(
            store,
            name,
            in_features=in_features,
            out_features=out_features,
            device=device_of(name),
            quantization_config=config.quantization_config,
        )

    quantized: set[str] = set()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]

    def first_part(name: str) -> str:  # a fused linear's format is its parts'
        return sources[name][0][0] if name in sources else name

    stored = [(n, m) for n, m in linears if linear_format(store, first_part(n)) != "dense"]

    def read_linear(entry: tuple[str, Linear]) -> list[Callable[[], nn.Module]]:
        name, module = entry
        if name in sources:  # each part read against its own width, as the module was built
            return [read(part, module.in_features, w) for part, w in sources[name]]
        return [read(name, module.in_features, module.out_features)]

    def build_linear(entry: tuple[str, Linear], builds: list[Callable[[], nn.Module]]) -> None:
        name, _ = entry
        parts = [build() for build in builds]
        if name in sources:
            # The plan checked that the parts' layouts allow it (engine/build_plan.py).
            replacement = concat_linears(parts)
            if replacement is None:
                names = ", ".join(part for part, _ in sources[name])
                raise WeightError(
                    f"{names} in {store.model_dir} cannot run as one linear (their formats "
                    "differ): load with fuse_projections=False"
                )
        else:
            replacement = parts[0]
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, replacement)
        quantized.add(name)
        if progress:
            fraction = QUANTIZED_SHARE * len(quantized) / len(stored)
            progress(fraction, f"quantized linears {len(quantized)}/{len(stored)}")

    # Linear i+1 is read while linear i is repacked (engine/read_ahead.py); the store is
    # this thread's again once it returns. Every read between these two points is made for
    # read_ahead's `read` (the builds read nothing: the pieces come with their tensors), and
    # what they cost this thread is what `waited` hears.
    before = store.read_seconds + store.place_seconds

    def waited(seconds: float) -> None:
        store.ahead_wait_seconds += seconds

    read_ahead(stored, read_linear, build_linear, waited=waited)
    store.ahead_seconds += store.read_seconds + store.place_seconds - before
    if quantized and torch.cuda.is_available():
        # Repacking (and fusing) on the GPU left its temporaries in the allocator's cache:
        # hand them back, so that nvidia-smi and other processes see what the model holds,
        # not the peak.
        torch.cuda.empty_cache()
    return quantized
