"""Measurement: how much error each candidate bit mix of a module puts into the residual
stream, layer by layer, with unquantized states fed forward (as exllamav2 measures).

    out_states, record = measure_layer(runner, i, states, scale_search="coarse",
                                       error_reference="layer", heldout=0.0,
                                       token_power=1.0)

For each module of the layer (attention, MLP) and each `ModuleCandidate` of its table,
every linear is GPTQ-quantized at the candidate's profile (each (linear, profile) once,
all profiles of a linear in one sweep: gptq.gptq_quantize_many),
the module is run on its calibration inputs, and the candidate is scored

    err = sqrt(mean over tokens t of ‖y_cand[t] − y_ref[t]‖² / ‖s[t]‖²)

with y the module's output and s the (unquantized) residual stream it is compared with:
- `error_reference="layer"` (the default): s is the layer's output, after the MLP, for
  both modules. In a layer whose MLP writes huge activations into the stream (SmolLM2's
  layer 0) the attention's errors then look 20-30x smaller than elsewhere.
- `error_reference="module"`: s is the stream right after the module (attention: h plus
  the attention's output, the input of the norm in front of the MLP; MLP: the layer's
  output), as exllamav2 normalizes.
The ratio is per token, because the stream of a row's first token (the attention sink)
grows to 100x the norm of the others in mid-depth layers (SmolLM2: 26 000 against 200); a
per-row Frobenius ratio, as exllamav2 computes it, is then dominated by that one token and
calls those layers' modules nearly error-free, and the allocation starves them. The
module's last linear (o_proj, down_proj) produces its output, so candidates that differ
only there share one forward of the rest of the module and differ by one matmul.

Token power (`token_power=q`, q ≥ 1): the mean over tokens becomes a power mean,

    err = (mean over t of (‖y_cand[t] − y_ref[t]‖² / ‖s[t]‖²)^q)^(1/(2q)),

q = 1 being the formula above. A larger q weighs the tokens a module gets most wrong,
where the mean is carried by the calibration text's common tokens. Measured on SmolLM2-135M
calibrated on English wiki (issue 29): q = 4 raises the early and late layers' levels
against the middle ones' (the geometric mean of a module's candidate errors) the way
measuring on multilingual text does (correlation 0.66 over the 60 modules, slope 1.0), and
q = 2 at 4.0 bpw lowered held-out perplexity on all five domains (multilingual -5.4%).

Rows (`scoring_rows`): by default the GPTQ Hessians use every measuring row and candidates
are scored on the same rows (in-sample, as exllamav2 does; the first rows holding
`score_tokens` tokens when that is set). With `heldout=f` (0 < f < 1) the last
round(f·R) rows (at least one, at most R−1) are only scored and the Hessians come from the
rows before them, so a candidate is not scored on the text its GPTQ was fitted to and its
in-sample optimism (held-out errors were 1.3-1.5x the in-sample ones for SmolLM2's MLPs,
1.0-1.2x for its attention, at every rung) does not favour the calibration text.
Contiguous blocks, not alternate rows: calibration rows interleave their sources (one of
each in turn), so a block holds a turn of every source where alternate rows would not.
The two parts run as two forwards of their rows, so measuring costs no more forwards.

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
from engine.quantizer.gptq import (
    DEFAULT_DAMP,
    gptq_quantize_many,
    prepare_hessian,
)
from engine.quantizer.model import CalibrationRunner, ModuleSpec, mid_stream_path, module_specs
from engine.quantizer.profiles import LADDER, ROLE_OF_LINEAR, ModuleCandidate, module_candidates

ERROR_REFERENCES = ("layer", "module")
# Hears a module's (kind, {linear name: dequantized weight}) at one rung.
KeepWeights = Callable[[str, dict[str, torch.Tensor]], None]


def scoring_rows(
    rows: int, length: int, *, heldout: float = 0.0, score_tokens: int | None = None
) -> tuple[int, int]:
    """(fit, scored) of `rows` measuring rows. In-sample (heldout 0) the Hessians take
    every row (fit = rows) and the scoring the first `scored`; held out, the Hessians take
    the first `fit` rows and the scoring the first `scored` of the rows after them."""
    if not 0.0 <= heldout < 1.0:
        raise ValueError(f"the held-out fraction must lie in [0, 1), got {heldout}")
    fit, scored = rows, rows
    if heldout > 0:
        if rows < 2:
            raise ValueError(
                f"held-out scoring needs at least 2 measuring rows, the calibration gave {rows}"
            )
        scored = min(rows - 1, max(1, round(heldout * rows)))
        fit = rows - scored
    if score_tokens is not None:
        scored = max(1, min(scored, score_tokens // length))
    return fit, scored


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
    damp: float = DEFAULT_DAMP,
    shrink: float = 0.0,
    score_tokens: int | None = None,
    error_reference: str = "layer",
    heldout: float = 0.0,
    token_power: float = 1.0,
    tick: Callable[[], None] | None = None,
    keep: tuple[int, KeepWeights] | None = None,
) -> tuple[torch.Tensor, dict[str, list[dict[str, Any]]]]:
    """(reference layer output [R, L, hidden], measurement record) for one loaded layer.

    The Hessians and the scored rows are `scoring_rows`' (module docstring): scoring on
    the first rows holding `score_tokens` tokens, when set, is enough because a relative
    error over a million values is a stable statistic, and the scoring forwards are most of
    the measurement's time.

    `keep` = (rung, fn): fn(kind, {linear name: dequantized weight}) hears each module's
    GPTQ result at that LADDER rung (the sensitivity probe's reference, sensitivity.py)."""
    if error_reference not in ERROR_REFERENCES:
        raise ValueError(
            f"error reference must be one of {', '.join(ERROR_REFERENCES)}, got {error_reference!r}"
        )
    if not token_power >= 1.0:
        raise ValueError(f"the token power must be at least 1, got {token_power}")
    layer = runner.lm.layers[layer_idx]
    specs = module_specs(layer)
    first = [g.names[0] for spec in specs for g in spec.groups]
    paths = [spec.path for spec in specs]
    mid = mid_stream_path(layer) if error_reference == "module" else None
    kept = [*paths, mid] if mid else paths
    total = states.shape[0]
    fit, rows = scoring_rows(total, states.shape[1], heldout=heldout, score_tokens=score_tokens)
    if fit == total:
        out, cap = capture_layer(
            runner, layer_idx, states, hessians=first, inputs=kept, outputs=paths
        )
        assert out is not None
        scored_out = out[:rows]
    else:
        # Two forwards, one per part: the fitting rows give the Hessians alone, the scored
        # rows the module inputs and outputs (nothing of the fitting rows is kept).
        fit_out, fitted = capture_layer(runner, layer_idx, states[:fit], hessians=first)
        rest_out, cap = capture_layer(runner, layer_idx, states[fit:], inputs=kept, outputs=paths)
        assert fit_out is not None and rest_out is not None
        cap.hessians = fitted.hessians
        out = torch.cat([fit_out, rest_out])
        scored_out = rest_out[:rows]
    out_norm = scored_out.float().norm(dim=-1).clamp_min(1e-12)  # [rows, L]
    stream_norms = {spec.kind: out_norm for spec in specs}
    if mid:
        after_attn = cap.inputs.pop(mid)[:rows]
        stream_norms["attn"] = after_attn.float().norm(dim=-1).clamp_min(1e-12)
    record: dict[str, list[dict[str, Any]]] = {}
    for spec in specs:
        record[spec.kind] = _measure_module(
            runner, layer_idx, layer, spec, cap, stream_norms[spec.kind], scale_search, damp,
            shrink, token_power, tick, keep,
        )  # fmt: skip
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
    shrink: float,
    token_power: float,
    tick: Callable[[], None] | None,
    keep: tuple[int, KeepWeights] | None = None,
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
        perm, upper = prepare_hessian(
            cap.hessians[group.names[0]], damp=damp, shrink=shrink, name=group.names[0]
        )
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

    if keep is not None:
        rung, hear = keep
        hear(spec.kind, {name: dequantized[name, rung] for name in spec.linears})

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
                runner, layer_idx, spec, out_linear, x_in, w_outs, y_ref, stream_norm,
                token_power,
            )  # fmt: skip
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
    token_power: float = 1.0,
) -> list[float]:
    """The score of each output weight in w_outs [n, d], the module run on x_in [R, L, d]
    with its other linears as they are set now (the power mean of token_power over the
    tokens' squared relative errors, as a root: module docstring).

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
            ratio = (diff / stream_norm[rows][:, :, None]).square().flatten(0, 1)  # [r·L, c]
            errs.append(ratio.double().pow(token_power) if token_power != 1 else ratio)
    finally:
        handle.remove()
    if token_power == 1:
        return torch.cat(errs).mean(dim=0).sqrt().tolist()
    return torch.cat(errs).mean(dim=0).pow(0.5 / token_power).tolist()
