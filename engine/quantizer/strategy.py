"""From a measurement to a per-layer strategy that meets the target bits per weight.

    slots = measurement_slots(lm, measurement)        # (bits, err) per candidate per module
    strategy, bpw, objective = choose_strategy(lm, measurement, target_bpw, error_norm=2.0)
    check_target_feasible(lm, target_bpw)             # before any work

Bits are the exact storage of what pack_exl2 writes (profiles.Profile.storage_bits), and
the budget is ⌊decoder linear weights × target bpw⌋, the head excluded (it has -hb).
A strategy is JSON-ready: [{"attn": {linear: profile name}, "mlp": {...}} per layer].

A measurement file (-om / -m) is {"format": MEASUREMENT_FORMAT, "model": {...},
"calibration": {...}, "layers": [{"attn": [{"profiles": {role: name}, "err": e}, ...],
"mlp": [...]}, ...]}, and when the sensitivity probe ran "sensitivity": [{"attn": {"kl",
"err"}, "mlp": {...}} per layer] (sensitivity.py); `check_measurement` refuses one made for
another model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from engine.modules import Linear
from engine.quantizer.measure import role_of
from engine.quantizer.model import LayerwiseModel, module_specs
from engine.quantizer.optimize import DEFAULT_NORM, BudgetError, allocate, feasible_range
from engine.quantizer.profiles import Profile, module_candidates
from engine.quantizer.sensitivity import module_weights

MEASUREMENT_FORMAT = "kestrel-exl2-measurement-1"


def layer_shapes(lm: LayerwiseModel, i: int) -> dict[str, dict[str, tuple[int, int, bool]]]:
    """{kind: {linear: (in_features, out_features, has_bias)}} of layer i (no weights read)."""
    layer = lm.layers[i]
    shapes: dict[str, dict[str, tuple[int, int, bool]]] = {}
    for spec in module_specs(layer):
        shapes[spec.kind] = {}
        for name in spec.linears:
            lin = layer.get_submodule(name)
            assert isinstance(lin, Linear)  # the model being quantized is dense
            shapes[spec.kind][name] = (lin.in_features, lin.out_features, lin.bias is not None)
    return shapes


def decoder_numel(lm: LayerwiseModel) -> int:
    return sum(
        k * n
        for i in range(lm.num_layers)
        for linears in layer_shapes(lm, i).values()
        for k, n, _ in linears.values()
    )


def candidate_bits(linears: dict[str, tuple[int, int, bool]], profiles: dict[str, str]) -> int:
    return sum(
        Profile.parse(profiles[role_of(name)]).storage_bits(k, n, bias=bias)
        for name, (k, n, bias) in linears.items()
    )


def _table_slots(lm: LayerwiseModel) -> list[list[tuple[int, float]]]:
    slots = []
    for i in range(lm.num_layers):
        for kind, linears in layer_shapes(lm, i).items():
            options = []
            for cand in module_candidates(kind):
                names = {role: cand.profile(role).name for role, _ in cand.rungs}
                options.append((candidate_bits(linears, names), 0.0))
            slots.append(options)
    return slots


def check_target_feasible(lm: LayerwiseModel, target_bpw: float) -> None:
    numel = decoder_numel(lm)
    low, high = feasible_range(_table_slots(lm))
    if low > numel * target_bpw:
        raise BudgetError(
            f"{target_bpw} bpw is below what this model can be stored in: the smallest "
            f"choice is {low / numel:.3f} bpw (scales and the act-order permutation cost "
            "bits on top of the codes; small matrices pay more). Use -b "
            f"{math.ceil(low / numel * 100) / 100:.2f} or more"
        )
    if high < numel * (target_bpw - 0.01):
        raise BudgetError(
            f"{target_bpw} bpw is above what this model can use: the largest choice is "
            f"{high / numel:.3f} bpw"
        )


def measurement_slots(
    lm: LayerwiseModel, measurement: dict[str, Any], *, sensitivity: bool = False
) -> tuple[list[list[tuple[int, float]]], list[tuple[int, str, Any, Any]]]:
    """Per module of every layer: its candidates' (bits, error), and where it is. With
    `sensitivity` each error is scaled by √w of the measurement's probe (sensitivity.py),
    so that the errors squared are the predicted KL at the output."""
    weights = module_weights(measurement["sensitivity"]) if sensitivity else None
    slots: list[list[tuple[int, float]]] = []
    options: list[tuple[int, str, Any, Any]] = []
    for i, record in enumerate(measurement["layers"]):
        for kind, linears in layer_shapes(lm, i).items():
            entries = record[kind]
            scale = math.sqrt(weights[i][kind]) if weights else 1.0
            slots.append(
                [(candidate_bits(linears, e["profiles"]), scale * float(e["err"])) for e in entries]
            )
            options.append((i, kind, linears, entries))
    return slots, options


def choose_strategy(
    lm: LayerwiseModel,
    measurement: dict[str, Any],
    target_bpw: float,
    *,
    error_norm: float = DEFAULT_NORM,
    sensitivity: bool = False,
) -> tuple[list[dict[str, dict[str, str]]], float, float]:
    """(strategy, predicted decoder bpw, predicted Σ err² of the choice), the choice
    minimizing Σ err^error_norm (optimize.allocate); with `sensitivity` the errors are
    weighed by the measurement's probe (measurement_slots) and Σ err² is a predicted KL."""
    numel = decoder_numel(lm)
    budget = int(numel * target_bpw)
    slots, options = measurement_slots(lm, measurement, sensitivity=sensitivity)
    choice = allocate(slots, budget, norm=error_norm)
    strategy: list[dict[str, dict[str, str]]] = [{} for _ in range(lm.num_layers)]
    bits = 0
    objective = 0.0
    for (i, kind, linears, entries), j, slot in zip(options, choice, slots, strict=True):
        profiles = entries[j]["profiles"]
        strategy[i][kind] = {name: profiles[role_of(name)] for name in linears}
        bits += slot[j][0]
        objective += slot[j][1] ** 2
    return strategy, bits / numel, objective


def model_signature(lm: LayerwiseModel) -> dict[str, Any]:
    return {
        "architecture": lm.config.architecture,
        "num_layers": lm.num_layers,
        "linears": {
            kind: {name: [k, n] for name, (k, n, _) in linears.items()}
            for kind, linears in layer_shapes(lm, 0).items()
        },
    }


def check_measurement(lm: LayerwiseModel, measurement: Any, source: str) -> None:
    if not isinstance(measurement, dict) or measurement.get("format") != MEASUREMENT_FORMAT:
        raise ValueError(f"{source} is not a Kestrel measurement file ({MEASUREMENT_FORMAT})")
    if measurement.get("model") != json.loads(json.dumps(model_signature(lm))):
        raise ValueError(f"{source} was measured on another model (its shapes differ)")
    layers = measurement.get("layers")
    if not isinstance(layers, list) or len(layers) != lm.num_layers:
        raise ValueError(f"{source} does not hold one record per layer ({lm.num_layers})")


def read_measurement(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"measurement file not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read measurement file {path}: {e}") from e


_STORED = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "bias")


def written_bpw(tensors: dict[str, torch.Tensor], lm: LayerwiseModel) -> float:
    """Bits per weight of the decoder's quantized linears, counted from their tensors."""
    bits = 0
    for name, t in tensors.items():
        if not name.startswith("model.layers.") or name.rsplit(".", 1)[-1] not in _STORED:
            continue
        if name.endswith(".bias") and name[: -len("bias")] + "q_weight" not in tensors:
            continue  # the bias of a linear left unquantized
        bits += t.numel() * t.element_size() * 8
    return bits / decoder_numel(lm)
