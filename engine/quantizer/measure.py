"""Measurement: how much error each candidate bit mix of a module puts into the residual
stream, layer by layer, with unquantized states fed forward (as exllamav2 measures).

    out_states, record = measure_layer(runner, i, states, scale_search="coarse")

For each module of the layer (attention, MLP) and each `ModuleCandidate` of its table,
every linear is GPTQ-quantized at the candidate's profile (each (linear, profile) once,
all profiles of a linear in one sweep: gptq.gptq_quantize_many),
the module is run on its calibration inputs, and the candidate is scored

    err = sqrt(mean over tokens t of ‖y_cand[t] − y_ref[t]‖² / ‖h_out[t]‖²)

with y the module's output and h_out the layer's (unquantized) output: the relative error
the module injects into the residual stream, per token. Per token, because the stream of
a row's first token (the attention sink) grows to 100x the norm of the others in
mid-depth layers (SmolLM2: 26 000 against 200); a per-row Frobenius ratio, as exllamav2
computes it, is then dominated by that one token and calls those layers' modules nearly
error-free, and the allocation starves them. The module's last linear (o_proj, down_proj)
produces its output, so candidates that differ only there share one forward of the rest
of the module and differ by one matmul.

`record` is JSON-ready: {"attn": [{"profiles": {role: profile name}, "err": e}, ...],
"mlp": [...]}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.modules import Linear
from engine.quantizer.capture import Capture, capture_layer
from engine.quantizer.gptq import gptq_quantize_many, prepare_hessian
from engine.quantizer.model import CalibrationRunner, ModuleSpec, module_specs
from engine.quantizer.profiles import LADDER, ROLE_OF_LINEAR, ModuleCandidate, module_candidates


def role_of(linear: str) -> str:
    leaf = linear.rsplit(".", 1)[-1]
    if leaf not in ROLE_OF_LINEAR:
        raise ValueError(f"the quantizer has no role for linear '{linear}'")
    return ROLE_OF_LINEAR[leaf]


def gptq_runs(layer: nn.Module) -> int:
    """GPTQ runs the measurement of one such layer makes (one per linear and rung)."""
    total = 0
    for spec in module_specs(layer):
        candidates = module_candidates(spec.kind)
        for name in spec.linears:
            total += len({dict(c.rungs)[role_of(name)] for c in candidates})
    return total


@torch.inference_mode()
def measure_layer(
    runner: CalibrationRunner,
    layer_idx: int,
    states: torch.Tensor,
    *,
    scale_search: str = "coarse",
    damp: float = 0.1,
    score_tokens: int | None = None,
    tick: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, dict[str, list[dict[str, Any]]]]:
    """(reference layer output [R, L, hidden], measurement record) for one loaded layer.

    Hessians use every row; candidates are scored on the first rows holding
    `score_tokens` tokens (all when None): a relative error over a million values is a
    stable statistic, and the scoring forwards are most of the measurement's time."""
    layer = runner.lm.layers[layer_idx]
    specs = module_specs(layer)
    first = [g.names[0] for spec in specs for g in spec.groups]
    paths = [spec.path for spec in specs]
    out, cap = capture_layer(runner, layer_idx, states, hessians=first, inputs=paths, outputs=paths)
    assert out is not None
    rows = states.shape[0]
    if score_tokens is not None:
        rows = max(1, min(rows, score_tokens // states.shape[1]))
    stream_norm = out[:rows].float().norm(dim=-1).clamp_min(1e-12)  # [rows, L]
    record: dict[str, list[dict[str, Any]]] = {}
    for spec in specs:
        record[spec.kind] = _measure_module(
            runner, layer_idx, layer, spec, cap, stream_norm, scale_search, damp, tick
        )
    return out, record


def _measure_module(
    runner: CalibrationRunner,
    layer_idx: int,
    layer: nn.Module,
    spec: ModuleSpec,
    cap: Capture,
    stream_norm: torch.Tensor,
    scale_search: str,
    damp: float,
    tick: Callable[[], None] | None,
) -> list[dict[str, Any]]:
    # Roles this module has (Phi-3's fused qkv_proj has no separate v): candidates that
    # differ only in absent roles are one candidate.
    present = {role_of(name) for name in spec.linears}
    unique: dict[tuple[tuple[str, int], ...], ModuleCandidate] = {}
    for cand in module_candidates(spec.kind):
        unique.setdefault(tuple((r, i) for r, i in cand.rungs if r in present), cand)
    candidates = [ModuleCandidate(key) for key in unique]
    linears: dict[str, Linear] = {}
    for name in spec.linears:
        linear = layer.get_submodule(name)
        assert isinstance(linear, Linear)  # the model being measured is dense
        linears[name] = linear
    originals = {name: lin.weight for name, lin in linears.items()}
    # Every (linear, rung) the table needs, quantized once.
    dequantized: dict[tuple[str, int], torch.Tensor] = {}
    for group in spec.groups:
        perm, upper = prepare_hessian(cap.hessians[group.names[0]], damp=damp, name=group.names[0])
        for name in group.names:
            rungs = sorted({dict(c.rungs)[role_of(name)] for c in candidates})
            # All rungs in one sweep: they share the row loop and the error feedback.
            swept = gptq_quantize_many(
                originals[name].float(), perm, upper, [LADDER[r] for r in rungs],
                name=name, scale_search=scale_search,
            )  # fmt: skip
            for rung, result in zip(rungs, swept, strict=True):
                # Kept in host memory: ten versions of a big layer would crowd a GPU.
                dequantized[name, rung] = result.dequantized.to("cpu", originals[name].dtype)
                if tick:
                    tick()

    out_name = spec.output_linear
    out_role = role_of(out_name)
    out_linear = linears[out_name]
    classes: dict[tuple[tuple[str, int], ...], list[ModuleCandidate]] = {}
    for cand in candidates:
        key = tuple((r, i) for r, i in cand.rungs if r != out_role)
        classes.setdefault(key, []).append(cand)

    rows = stream_norm.shape[0]
    # Every candidate class runs on the same scoring rows: on a GPU they go there once per
    # module, not once per class (the runner's .to() is then a no-op).
    device = runner.lm.device
    x_in = cap.inputs[spec.path][:rows].to(device)
    y_ref = cap.outputs[spec.path][:rows].to(device)
    results: list[dict[str, Any]] = []
    try:
        for key, members in classes.items():
            chosen = dict(key)
            for name, lin in linears.items():
                if name != out_name:
                    w = dequantized[name, chosen[role_of(name)]]
                    lin.weight = nn.Parameter(w.to(originals[name].device))
            w_outs = [dequantized[out_name, dict(c.rungs)[out_role]] for c in members]
            errs = _candidate_errors(
                runner, layer_idx, spec, out_linear, x_in, w_outs, y_ref, stream_norm
            )
            for cand, err in zip(members, errs, strict=True):
                profiles = {role: LADDER[i].name for role, i in cand.rungs}
                results.append({"profiles": profiles, "err": err})
    finally:
        for name, lin in linears.items():
            lin.weight = originals[name]
    return results


class _StopAtOutputLinear(Exception):
    pass


def _candidate_errors(
    runner: CalibrationRunner,
    layer_idx: int,
    spec: ModuleSpec,
    out_linear: Linear,
    x_in: torch.Tensor,
    w_outs: list[torch.Tensor],
    y_ref: torch.Tensor,
    stream_norm: torch.Tensor,
) -> list[float]:
    """The score of each output weight in w_outs [n, d], the module run on x_in [R, L, d]
    with its other linears as they are set now.

    Chunk by chunk: the module's forward stops at its output linear (whose own matmul
    would be wasted work, every candidate applies its own: a third of an MLP forward),
    and that input z goes straight into one matmul for all of w_outs. z never leaves the
    device: it used to be gathered on the host and sent back, a round trip of the whole
    module's activations per candidate class on a GPU."""
    device, dtype = runner.lm.device, runner.lm.dtype
    count, n = len(w_outs), w_outs[0].shape[0]
    w_all = torch.cat([w.to(device) for w in w_outs])  # [count·n, d]
    bias = out_linear.bias
    bias_all = bias.repeat(count) if bias is not None else None
    length = x_in.shape[1]
    grabbed: list[torch.Tensor] = []

    def grab(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        grabbed.append(args[0])
        raise _StopAtOutputLinear

    errs = []
    handle = out_linear.register_forward_pre_hook(grab)
    try:
        for rows in runner.chunks(x_in.shape[0]):
            grabbed.clear()
            try:
                runner.run_module(layer_idx, spec.path, x_in[rows])
            except _StopAtOutputLinear:
                pass
            z = grabbed[0].reshape(-1, length, grabbed[0].shape[-1]).to(device, dtype)
            y = F.linear(z, w_all, bias_all).float()
            y = y.unflatten(-1, (count, n))  # [r, L, count, n]
            diff = (y - y_ref[rows].float()[:, :, None]).norm(dim=-1).cpu()
            errs.append((diff / stream_norm[rows][:, :, None]).square().flatten(0, 1))  # [r·L, c]
    finally:
        handle.remove()
    return torch.cat(errs).mean(dim=0).sqrt().tolist()
