"""Load flow: model directory -> config -> architecture -> weights on devices.

The model is built on the meta device, then each parameter is read from the safetensors
store straight onto its layer's device in the target dtype (gpt-fast's pattern): no second
copy of the model in host memory, and a shape mismatch is reported per tensor by name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine.architectures import CausalLM, architecture_class
from engine.config import ModelConfig
from engine.weights import WeightError, WeightStore

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


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None picks float16 on a GPU and float32 on the CPU (CPU half matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype is None or dtype == "auto":
        resolved = torch.float16 if device.type == "cuda" else torch.float32
    elif dtype in DTYPES:
        resolved = DTYPES[dtype]
    else:
        raise ValueError(f"dtype '{dtype}' is not supported (use float16, bfloat16 or float32)")
    if resolved not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype {resolved} is not supported (use float16, bfloat16 or float32)")
    return resolved


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
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


def load_causal_lm(
    model_dir: str | Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    config: ModelConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> CausalLM:
    config = config or ModelConfig.from_dir(model_dir)
    cls = architecture_class(config.architecture, source=config.source)
    store = WeightStore(model_dir)
    with torch.device("meta"):
        model = cls(config)
    model.layer_devices = [device] * config.num_hidden_layers
    _reject_unsupported_formats(model, store)

    params = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    tied = config.tie_word_embeddings
    for i, (name, param) in enumerate(params):
        if tied and name == "lm_head.weight":
            continue
        if name not in store:
            if name == "lm_head.weight":
                raise WeightError(
                    f"tensor 'lm_head.weight' not found in {model_dir} and the config does "
                    "not tie it to the embeddings (tie_word_embeddings is false)"
                )
            raise WeightError(f"tensor '{name}' not found in {model_dir}")
        tensor = store.get(name, dtype=dtype, device=device, shape=tuple(param.shape))
        _set_parameter(model, name, tensor)
        if progress:
            progress(i + 1, len(params))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    store.close()
    model.eval()
    return model


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


def _reject_unsupported_formats(model: nn.Module, store: WeightStore) -> None:
    from engine.modules import Linear

    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if f"{name}.q_weight" in store:
            raise WeightError(
                f"'{name}' is stored as EXL2 ({name}.q_weight); this version of Kestrel "
                "loads FP16/BF16/FP32 weights only"
            )
        if f"{name}.qweight" in store:
            raise WeightError(
                f"'{name}' is stored as GPTQ ({name}.qweight); this version of Kestrel "
                "loads FP16/BF16/FP32 weights only"
            )
