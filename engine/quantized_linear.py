"""Per-linear weight-format detection and the quantized linear module.

Formats are detected from tensor names, as exllamav2 does: `<name>.q_weight` → EXL2,
`<name>.qweight` → GPTQ, `<name>.weight` → dense. A quantized linear is repacked at load
time into the runtime layout of docs/quant_layout.md and runs through
`kernels.quant_matmul` (Triton on a GPU, dequantize + matmul on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import kernels
from engine.quant.exl2 import Exl2Tensors, exl2_to_runtime
from engine.quant.gptq import GptqTensors, gptq_to_runtime
from engine.weights import WeightStore
from kernels.quant_matmul import (
    QuantizedWeight,
    dequantize_reference,
    quant_matmul,
    quant_matmul_silu_mul,
)
from kernels.quant_matmul.layout import stored_bytes

if TYPE_CHECKING:  # engine.lora's modules import this one
    from engine.lora.batch import LoraBatch

EXL2_TENSORS = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "q_perm", "bias")
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx", "bias")


class QuantizedLinear(nn.Module):
    """y = x W + b with W held quantized; same interface as engine.modules.Linear."""

    def __init__(self, weight: QuantizedWeight, out_features: int, fmt: str) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features = weight.in_features
        # EXL2 pads n to a multiple of 32; the model sees only its own out_features.
        self.out_features = out_features
        self.format = fmt

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """`lora` is for LoRA's wrappers, which take a linear's place (engine/modules.py)."""
        if x.device.type == "cpu":
            y = self._cpu_matmul(x)
        else:
            y = quant_matmul(x, self.qweight)
        if y.shape[-1] != self.out_features:
            y = y[..., : self.out_features]
        return y

    def forward_silu_mul(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """silu(gate) * up of this linear's output [gate | up] (a gated MLP's gate_up_proj):
        the bits of `kernels.silu_mul` on the halves of `forward(x)`. On CUDA one call of
        kernels.quant_matmul_silu_mul, whose decode GEMV ends in the product itself (one
        kernel and the [T, 2I] intermediate fewer, issue 31). `lora` as for `forward`."""
        if x.device.type == "cpu" or self.qweight.out_features != self.out_features:
            gate, up = self.forward(x).chunk(2, dim=-1)  # a padded or CPU weight: two ops
            return kernels.silu_mul(gate, up)
        return quant_matmul_silu_mul(x, self.qweight)

    def _cpu_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The CPU has no dequantizing kernels: unpacking the bit planes on every call made a
        135M EXL2 model decode at well under 1 tok/s. The weight is dequantized once, on first
        use, into a float32 [k, n] kept beside the packed tensors (the reference's exact
        values: same result as quant_matmul_reference, 4 bytes per weight of host memory)."""
        dense = getattr(self, "_cpu_dense", None)
        if dense is None:
            dense = self._cpu_dense = dequantize_reference(self.qweight)
        y = x.float() @ dense
        if self.qweight.bias is not None:
            y = y + self.qweight.bias.float()
        return y.to(x.dtype)

    @property
    def storage_bits(self) -> int:
        """Bits stored for this linear (codes, scales, zeros, permutation, groups)."""
        qw = self.qweight
        total = sum(p.packed.numel() * 32 for s in qw.segments for p in s.planes)
        total += qw.scales.numel() * 16 + stored_bytes(qw.zeros) * 8
        total += qw.row_group.numel() * 32
        return total + (qw.perm.numel() * 32 if qw.perm is not None else 0)

    def extra_repr(self) -> str:
        bits = "/".join(str(s.bits) for s in self.qweight.segments)
        return f"{self.format}, in={self.in_features}, out={self.out_features}, bits={bits}"


def linear_format(store: WeightStore, name: str) -> str:
    if f"{name}.q_weight" in store:
        return "exl2"
    if f"{name}.qweight" in store:
        return "gptq"
    return "dense"


def load_quantized_linear(
    store: WeightStore,
    name: str,
    *,
    in_features: int,
    out_features: int,
    device: torch.device,
    quantization_config: dict[str, Any] | None,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> QuantizedLinear:
    """Read, validate and repack one quantized linear; errors name the tensor. `tensors`:
    the linear's tensors (by their names without the prefix, as q_weight) already read, in
    place of reading them from `store` (a tensor-parallel rank's part of a linear,
    engine/tensor_parallel/cut_load.py)."""
    if device.type == "cuda":
        try:
            return _load_quantized_linear(
                store,
                name,
                in_features,
                out_features,
                device,
                quantization_config,
                device,
                tensors,
            )
        except torch.cuda.OutOfMemoryError:
            pass  # repacking's temporaries did not fit: do it on the CPU
        # Outside the except block, whose traceback held the failed attempt's tensors.
        torch.cuda.empty_cache()
    return _load_quantized_linear(
        store,
        name,
        in_features,
        out_features,
        device,
        quantization_config,
        torch.device("cpu"),
        tensors,
    )


def read_quantized_linear(
    store: WeightStore,
    name: str,
    *,
    in_features: int,
    out_features: int,
    device: torch.device,
    quantization_config: dict[str, Any] | None,
) -> Callable[[], QuantizedLinear]:
    """Read quantized linear `name`'s tensors into host memory now; the function returned
    validates and repacks them onto `device` (load_quantized_linear) when called. A load
    reads one linear while it repacks the one before (engine/read_ahead.py)."""
    fmt = linear_format(store, name)
    if fmt == "dense":
        raise ValueError(f"'{name}' is not quantized")
    names = EXL2_TENSORS if fmt == "exl2" else GPTQ_TENSORS
    tensors = {n: store.get(f"{name}.{n}") for n in names if f"{name}.{n}" in store}
    return partial(
        load_quantized_linear,
        store,
        name,
        in_features=in_features,
        out_features=out_features,
        device=device,
        quantization_config=quantization_config,
        tensors=tensors,
    )


def _load_quantized_linear(
    store: WeightStore,
    name: str,
    in_features: int,
    out_features: int,
    device: torch.device,
    quantization_config: dict[str, Any] | None,
    work: torch.device,
    given: Mapping[str, torch.Tensor] | None = None,
) -> QuantizedLinear:
    """load_quantized_linear, repacking on `work`: the target GPU where there is one. An
    EXL2 segment of 3, 5 or 6 bits is unpacked and re-planed code by code: an 8B model took
    12-28 s to load with that done on the H100 machine's CPU, 2.3 s on its GPU (exllamav2:
    2.6 s)."""
    fmt = linear_format(store, name)
    prefix = f"{name}."

    def read(names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        if given is not None:
            return {n: t.to(work) for n, t in given.items() if n in names}
        return {n: store.get(prefix + n).to(work) for n in names if prefix + n in store}

    if fmt == "exl2":
        tensors = read(EXL2_TENSORS)
        exl2 = Exl2Tensors.from_dict(tensors)
        exl2.validate(name, in_features, out_features)
        runtime = exl2_to_runtime(exl2)
    elif fmt == "gptq":
        tensors = read(GPTQ_TENSORS)
        qcfg = quantization_config or {}
        checkpoint_format = str(qcfg.get("checkpoint_format", "gptq"))
        bits = qcfg.get("bits")
        if bits is None:  # infer from shapes: qweight packs 32/bits rows per int32
            bits = tensors["qweight"].shape[0] * 32 // in_features
        gptq = GptqTensors.from_dict(tensors, bits=int(bits), checkpoint_format=checkpoint_format)
        gptq.validate(name, in_features, out_features)
        runtime = gptq_to_runtime(gptq)
    else:
        raise ValueError(f"'{name}' is not quantized")
    runtime = runtime.to(device)
    runtime.validate()
    return QuantizedLinear(runtime, out_features, fmt)
