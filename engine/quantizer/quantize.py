"""The quantization pass: each layer's linears by GPTQ, fed by already-quantized layers.

    out_states, tensors, errors = quantize_layer(runner, i, states, layer_strategy)
    tensors, error, dequantized = quantize_head(lm, runner, states, head_bits)
    tensors, errors = rtn_quantize_layer(lm, i, layer_strategy)     # convert.py --rtn
    tensors = rtn_quantize_head(lm, head_bits)

Contract:
- Linear groups are quantized in forward order (q/k/v, o, gate/up, down). Each group's
  Hessian is collected from a forward of the layer as it stands, i.e. with the groups
  before it already quantized, and that forward stops at the group, so the inputs every
  linear is fitted to are the ones it will see at inference (quantized states in,
  quantized earlier linears). Once the attention is quantized its output is kept and
  replayed (capture.py) in the later forwards instead of being computed again.
- A quantized linear's weight is replaced by its dequantized value (so later groups and
  the next layer see it), and its packed tensors are checked by dequantizing them again
  (gptq.check_reconstruction).
- `tensors` holds the layer's checkpoint tensors: the EXL2 tensors of every linear and
  the layer's other parameters (norms) in float16, under their checkpoint names.
- `errors` maps each linear to tr(ΔW H ΔWᵀ)/tr(W H Wᵀ), its relative output error on the
  calibration inputs (a progress-bar diagnostic).
- Round to nearest (`rtn_*`) reads the weights alone: no calibration forward, no hidden
  states, the same tensors as GPTQ with gptq.rtn_factors gives. Its `errors` are the
  relative weight errors ‖ΔW‖²/‖W‖² (H = I), as no inputs are run.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.modules import Linear
from engine.quantizer.capture import capture_layer
from engine.quantizer.gptq import (
    DEFAULT_DAMP,
    GptqResult,
    gptq_quantize,
    output_error,
    prepare_hessian,
    rtn_quantize,
)
from engine.quantizer.model import CalibrationRunner, LayerwiseModel, module_specs
from engine.quantizer.profiles import HEAD_PROFILES, Profile


@torch.inference_mode()
def quantize_layer(
    runner: CalibrationRunner,
    layer_idx: int,
    states: torch.Tensor,
    layer_strategy: dict[str, dict[str, str]],
    *,
    scale_search: str = "fast",
    damp: float = DEFAULT_DAMP,
    shrink: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    lm = runner.lm
    layer = lm.layers[layer_idx]
    prefix = f"model.layers.{layer_idx}."
    tensors: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    linear_names: list[str] = []
    specs = module_specs(layer)
    attn_path = next(spec.path for spec in specs if spec.kind == "attn")
    # The attention's output, once its linears are all quantized (first MLP group's
    # forward): the MLP groups' later forwards and the layer's output replay it.
    attn_out: dict[str, torch.Tensor] = {}
    for spec in specs:
        for group in spec.groups:
            first = group.names[0]
            keep = [attn_path] if spec.kind == "mlp" and not attn_out else []
            _, cap = capture_layer(
                runner,
                layer_idx,
                states,
                hessians=[first],
                outputs=keep,
                stop_at=first,
                replay=attn_out,
            )
            attn_out.update(cap.outputs)
            hessian = cap.hessians[first]
            perm, upper = prepare_hessian(hessian, damp=damp, shrink=shrink, name=prefix + first)
            for name in group.names:
                linear = layer.get_submodule(name)
                assert isinstance(linear, Linear)  # the model being quantized is dense
                profile = Profile.parse(layer_strategy[spec.kind][name])
                weight = linear.weight.float()
                result = gptq_quantize(
                    weight, perm, upper, profile, name=prefix + name, scale_search=scale_search
                )
                packed = result.pack(linear.bias)
                tensors.update({f"{prefix}{name}.{k}": v.cpu() for k, v in packed.items()})
                errors[name] = output_error(weight, result.dequantized, hessian)
                linear.weight = nn.Parameter(result.dequantized.to(linear.weight.dtype))
                linear_names.append(name)
    for name, _ in layer.named_parameters():
        if not any(name.startswith(lin + ".") for lin in linear_names):
            tensors[prefix + name] = lm.store.get(prefix + name, dtype=torch.float16)
    out, _ = capture_layer(runner, layer_idx, states, replay=attn_out)
    assert out is not None
    return out, tensors, errors


@torch.inference_mode()
def quantize_head(
    lm: LayerwiseModel,
    runner: CalibrationRunner,
    states: torch.Tensor,
    head_bits: int,
    *,
    scale_search: str = "fast",
    damp: float = DEFAULT_DAMP,
    shrink: float = 0.0,
) -> tuple[dict[str, torch.Tensor], float, torch.Tensor]:
    """lm_head's EXL2 tensors (from the final norm of the last layer's quantized output),
    its relative output error and its dequantized weight [vocab, hidden] (float32)."""
    norm = lm.final_norm()
    hessian = None
    for rows in runner.chunks(states.shape[0]):
        x = norm(states[rows].to(lm.device, lm.dtype)).reshape(-1, states.shape[-1]).float()
        hessian = x.t() @ x if hessian is None else hessian.addmm_(x.t(), x)
    assert hessian is not None
    weight = lm.head_weight()
    perm, upper = prepare_hessian(hessian, damp=damp, shrink=shrink, name="lm_head")
    result = gptq_quantize(
        weight, perm, upper, HEAD_PROFILES[head_bits], name="lm_head", scale_search=scale_search
    )
    bias = lm.store.get("lm_head.bias", dtype=torch.float16) if "lm_head.bias" in lm.store else None
    packed = result.pack(bias)
    error = output_error(weight, result.dequantized, hessian)
    return {f"lm_head.{k}": v.cpu() for k, v in packed.items()}, error, result.dequantized


@torch.inference_mode()
def rtn_quantize_layer(
    lm: LayerwiseModel,
    layer_idx: int,
    layer_strategy: dict[str, dict[str, str]],
    *,
    scale_search: str = "fast",
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A loaded layer's checkpoint tensors rounded to nearest (see the module docstring)."""
    layer = lm.layers[layer_idx]
    prefix = f"model.layers.{layer_idx}."
    tensors: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    linear_names: list[str] = []
    for spec in module_specs(layer):
        for name in spec.linears:
            linear = layer.get_submodule(name)
            assert isinstance(linear, Linear)  # the model being quantized is dense
            profile = Profile.parse(layer_strategy[spec.kind][name])
            weight = linear.weight.float()
            result = rtn_quantize(weight, profile, name=prefix + name, scale_search=scale_search)
            packed = result.pack(linear.bias)
            tensors.update({f"{prefix}{name}.{k}": v.cpu() for k, v in packed.items()})
            errors[name] = _weight_error(weight, result)
            linear_names.append(name)
    for name, _ in layer.named_parameters():
        if not any(name.startswith(lin + ".") for lin in linear_names):
            tensors[prefix + name] = lm.store.get(prefix + name, dtype=torch.float16)
    return tensors, errors


@torch.inference_mode()
def rtn_quantize_head(
    lm: LayerwiseModel, head_bits: int, *, scale_search: str = "fast"
) -> tuple[dict[str, torch.Tensor], float]:
    """lm_head's EXL2 tensors rounded to nearest."""
    weight = lm.head_weight()
    profile = HEAD_PROFILES[head_bits]
    result = rtn_quantize(weight, profile, name="lm_head", scale_search=scale_search)
    bias = lm.store.get("lm_head.bias", dtype=torch.float16) if "lm_head.bias" in lm.store else None
    packed = result.pack(bias)
    return {f"lm_head.{k}": v.cpu() for k, v in packed.items()}, _weight_error(weight, result)


def _weight_error(weight: torch.Tensor, result: GptqResult) -> float:
    """‖ΔW‖² / ‖W‖²."""
    num = (result.dequantized - weight).square().sum()
    return float(num / weight.square().sum().clamp_min(1e-30))
