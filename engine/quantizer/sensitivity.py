"""How much each measured module's error costs at the model's output (issue 29).

The measurement scores a candidate by the noise it puts into the residual stream at its
own layer, relative to that stream (measure.py). Equal relative noise does not cost the
same everywhere: Gemma-3-270M reads its early and late layers' noise far more loudly than
its middle ones', so an allocation that minimizes Σ err² over the modules starved the
layers that mattered (4.0 bpw: wiki perplexity 26.7 against 14.4 when each module's errors
were weighed by a perplexity probe of the module, on a CPU).

The probe here runs in the measurement pass. A few measuring rows (`probe_rows`) are kept
in copies of the stream: copy 0 is clean (every layer as measured: unquantized), and at
each layer i two copies branch off it: the layer run with its attention's linears at the
reference rung (`REFERENCE_RUNG`, 4 bits, group 128, the measurement's own GPTQ result),
and the layer with its MLP's so. Every copy then goes on through the unquantized layers
after it. At the end all copies pass the final norm and the head, and each branch's cost
is the mean over the probe's tokens of KL(clean ‖ branch) of the next-token
distributions. KL, not the change of the text's log-likelihood: the latter's first-order
term has a random sign and drowned the small modules' effects in noise (a perplexity probe
did worse than no probe on SmolLM2-135M), while KL is second order, never negative, and
its token-to-token spread is shared by all branches (the same tokens).

To second order KL grows with the square of the injected noise, so a module's cost is
modelled as w · err² with w = KL / err_ref², err_ref the reference candidate's measured
error. `weighted_errors` scales every candidate's error of the module by √w: the
allocation's Σ err² becomes the predicted total KL of the choice.

Cost: the copies grow by two a layer, so the probe's forwards are about L² layer-forwards
of its rows for L layers (L/2 forwards of the probe rows per layer on average), and
2L + 1 head passes at the end. With `PROBE_TOKENS` tokens that is small against the
measurement's GPTQ runs and candidate scoring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantizer.model import CalibrationRunner, LayerwiseModel
from engine.quantizer.profiles import LADDER
from kernels.rms_norm import rms_norm_reference

SENSITIVITIES = ("kl", "off")
# The rung every module is probed at: 4 bits, group 128 (each of its linears).
REFERENCE_RUNG = 4
# Tokens the probe follows, by device, in up to PROBE_ROWS rows: the calibration rows
# interleave their sources, so the first rows are one of each.
PROBE_TOKENS = {"cuda": 8192, "cpu": 2048}
# `--fast` on a CPU: half, for half the probe's time (its head passes over a large
# vocabulary are most of it there: Gemma's 262 144 rows).
PROBE_TOKENS_FAST_CPU = 1024
PROBE_ROWS = 4
# The copies at the end (2L + 1 of [tokens, hidden]) stay within this many bytes: they are
# in host memory and saved with every layer's states (for a resume), so a large model
# follows fewer tokens per row (each row's first ones: the model is causal).
PROBE_BYTES = 1 << 30
# A branch whose KL is this small a fraction of the median branch's weight is weighed at
# it: its noise is numerical, and a weight of zero would let the allocation give the
# module nothing (every candidate the same error).
WEIGHT_FLOOR = 1e-3
# Tokens per head pass at the end (the clean logits, capped logits and probabilities are
# [tokens, vocab] float32 each: 256 MiB at a vocabulary of 262 144).
_HEAD_TOKENS = 256
# Vocabulary entries per slice of the head on a CPU: a branch's shifts are [256, 16384]
# float32 (16 MiB) in each elementwise pass, not a whole block's 256 MiB.
_CPU_VOCAB_SLICE = 16384


def probe_shape(
    rows: int,
    length: int,
    *,
    layers: int,
    hidden: int,
    element_bytes: int,
    device_type: str,
    fast: bool = False,
) -> tuple[int, int]:
    """(rows, tokens per row) the probe follows: the first tokens of the first rows."""
    count = max(1, min(rows, PROBE_ROWS))
    if device_type == "cuda":
        tokens = PROBE_TOKENS["cuda"] // count
    else:
        tokens = (PROBE_TOKENS_FAST_CPU if fast else PROBE_TOKENS["cpu"]) // count
    affordable = PROBE_BYTES // ((2 * layers + 1) * hidden * element_bytes * count)
    per_row = min(length, tokens, affordable)
    # Whole blocks of 64 where that leaves any (kernel-friendly), never below 16 tokens.
    per_row = per_row // 64 * 64 if per_row >= 64 else per_row
    return count, max(min(16, length), per_row)


def reference_profile() -> str:
    return LADDER[REFERENCE_RUNG].name


class SensitivityProbe:
    """The probe's stream copies [C, P, L, hidden] (host memory, the working dtype) and
    what each copy is: copy 0 clean, then (layer, kind) for each branch in order."""

    def __init__(self, copies: torch.Tensor, branches: list[tuple[int, str]]) -> None:
        if copies.shape[0] != len(branches) + 1:
            raise ValueError(f"{copies.shape[0]} probe copies for {len(branches)} branches")
        self.copies = copies
        self.branches = branches

    @classmethod
    def start(cls, states: torch.Tensor) -> SensitivityProbe:
        """From the embedded probe rows [P, L, hidden]."""
        return cls(states.detach().cpu()[None].clone(), [])

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a resumed measurement needs: the copies and the branches' (layer, kind)."""
        kinds = torch.tensor([0 if k == "attn" else 1 for _, k in self.branches])
        layers = torch.tensor([i for i, _ in self.branches])
        return {"probe": self.copies, "probe_layers": layers, "probe_kinds": kinds}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> SensitivityProbe:
        layers = tensors["probe_layers"].tolist()
        kinds = ["attn" if k == 0 else "mlp" for k in tensors["probe_kinds"].tolist()]
        return cls(tensors["probe"], list(zip(layers, kinds, strict=True)))

    @torch.inference_mode()
    def advance(
        self,
        runner: CalibrationRunner,
        layer_idx: int,
        references: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        """Every copy through loaded layer `layer_idx`, then one branch per module of
        `references` ({kind: {linear name: reference weight}}) off the clean copy."""
        count, rows, length, hidden = self.copies.shape
        flat = self.copies.reshape(count * rows, length, hidden)
        out = [runner.run_layer(layer_idx, flat).reshape(count, rows, length, hidden)]
        clean_in = self.copies[0]
        layer = runner.lm.layers[layer_idx]
        for kind, weights in references.items():
            with _weights_set(layer, weights):
                out.append(runner.run_layer(layer_idx, clean_in)[None])
            self.branches.append((layer_idx, kind))
        self.copies = torch.cat(out)

    def head_passes(self) -> int:
        """How many blocks of tokens `costs` takes through the head (its tick count)."""
        tokens = self.copies.shape[1] * self.copies.shape[2]
        return -(-tokens // _HEAD_TOKENS)

    @torch.inference_mode()
    def costs(self, lm: LayerwiseModel, tick: Callable[[], None] | None = None) -> list[float]:
        """Each branch's mean KL(clean ‖ branch) over the probe's tokens, in nats; `tick`
        hears each block of tokens done (`head_passes` of them)."""
        norm = lm.final_norm()
        weight = lm.head_weight()
        # The branches' logits go through the head as differences from the clean ones
        # (below), so a low-precision matmul errs relative to the difference, not to the
        # logits: bf16 where the CPU multiplies it natively (2.5-4x fp32's speed there).
        delta_weight = weight.to(torch.bfloat16) if _fast_bf16(weight.device) else weight
        cap = getattr(lm.model, "final_logit_softcap", None)
        hidden = self.copies.shape[-1]
        flat = self.copies.reshape(self.copies.shape[0], -1, hidden)
        tokens = flat.shape[1]
        totals = torch.zeros(len(self.branches), dtype=torch.float64)

        def normed(x: torch.Tensor) -> torch.Tensor:
            # In float32 throughout: a branch enters the head as its difference from the
            # clean copy, and rounding both norms to fp16 first would put ~1e-3 of the
            # hidden state's size into a difference that is a few percent of it.
            x32 = x.to(lm.device, torch.float32)
            return rms_norm_reference(
                x32, norm.weight.float(), norm.eps, unit_offset=norm.unit_offset
            )

        def capped(logits: torch.Tensor) -> torch.Tensor:
            return logits if cap is None else torch.tanh(logits / cap) * cap

        vocab_slice = weight.shape[0] if weight.device.type == "cuda" else _CPU_VOCAB_SLICE
        for start in range(0, tokens, _HEAD_TOKENS):
            part = slice(start, min(tokens, start + _HEAD_TOKENS))
            h_clean = normed(flat[0, part])
            raw_clean = F.linear(h_clean, weight)
            z_clean = capped(raw_clean)
            p = torch.softmax(z_clean, dim=-1)

            def shifts(
                dh: torch.Tensor,
                rows: Any,
                cols: slice,
                raw_clean: torch.Tensor = raw_clean,
                z_clean: torch.Tensor = z_clean,
            ) -> torch.Tensor:
                """z_branch − z_clean for the block's `rows` (dh holds them) over the
                vocabulary entries `cols`, float32."""
                dz = F.linear(dh, delta_weight[cols]).float()
                if cap is None:
                    return dz
                return capped(raw_clean[rows, cols] + dz) - z_clean[rows, cols]

            for b in range(len(self.branches)):
                dh = (normed(flat[b + 1, part]) - h_clean).to(delta_weight.dtype)
                kl = _branch_kl(p, z_clean, dh, shifts, vocab_slice)
                totals[b] += kl.clamp_min(0).sum().item()
            if tick:
                tick()
        return (totals / tokens).tolist()


def _branch_kl(
    p: torch.Tensor,
    z_clean: torch.Tensor,
    dh: torch.Tensor,
    shifts: Callable[[torch.Tensor, Any, slice], torch.Tensor],
    vocab_slice: int,
) -> torch.Tensor:
    """KL(p ‖ q) per row for q = softmax(z_clean + dz), dz = shifts(dh, rows, cols): from
    the moments of the shifts over vocabulary slices, and for the rows whose moments
    overflow (a shift past exp's float32 range, or 0 · inf where p underflowed) by the
    direct form, those rows alone. The moments take p e^dz in float32, so they assume no
    large shift where p is subnormal: logits in the hundreds, not a real head's."""
    vocab = p.shape[1]
    mean_shift = torch.zeros(p.shape[0], dtype=torch.float64, device=p.device)
    mean_growth = torch.zeros_like(mean_shift)
    for v in range(0, vocab, vocab_slice):
        cols = slice(v, min(vocab, v + vocab_slice))
        dz, pc = shifts(dh, slice(None), cols), p[:, cols]
        mean_shift += torch.linalg.vecdot(pc, dz).double()
        # e^dz − 1 as exp, then − 1 (exact for e^dz in [0.5, 2]): 3x faster than expm1 on
        # a CPU, and exp's rounding (about an ulp an entry) is weighted by p in the sum.
        mean_growth += torch.linalg.vecdot(pc, dz.exp_().sub_(1)).double()
    kl = _kl_of_moments(mean_growth, mean_shift)
    broken = ~torch.isfinite(kl)
    if broken.any():
        # The direct form's float32 bias (~1e-3 nats at Gemma's vocabulary) stays in these
        # rows; log p comes from the logits, so an entry whose p underflowed still counts.
        z = z_clean[broken]
        dz = shifts(dh[broken], broken, slice(0, vocab))
        log_p, log_q = torch.log_softmax(z, dim=-1), torch.log_softmax(z + dz, dim=-1)
        kl[broken] = (p[broken] * (log_p - log_q)).sum(dim=-1).double()
    return kl


def _kl_of_moments(mean_growth: torch.Tensor, mean_shift: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per row for q = softmax(log p + dz), from E_p[e^dz − 1] and E_p[dz]:
    log E_p[e^dz] − E_p[dz].

    Both moments are of the shifts dz, which are small against the logits (one module at 4
    bits), so nothing large cancels; the same KL as Σp·log p − Σp·z_q + logsumexp(z_q) in
    float32 cancelled terms the size of the logits and biased every branch by about +0.0014
    nats over Gemma's 262 144 entries. On Gemma-3-270M's head this form with bf16 shifts
    stays within 0.2% of float64 (fp32 shifts: within 0.01%).
    """
    return torch.log1p(mean_growth) - mean_shift


def _fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls are native on this CPU (AMX or AVX512-BF16); a GPU keeps float32
    (its head passes are a small part of a measurement)."""
    if device.type != "cpu":
        return False
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


@contextmanager
def _weights_set(layer: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """The layer's linears `weights` set for the duration (restored after)."""
    originals: dict[str, torch.Tensor] = {}
    for name in weights:
        weight = layer.get_submodule(name).weight
        assert isinstance(weight, torch.Tensor)
        originals[name] = weight
    try:
        for name, w in weights.items():
            original = originals[name]
            layer.get_submodule(name).weight = nn.Parameter(
                w.to(original.device, original.dtype), requires_grad=False
            )
        yield
    finally:
        for name, original in originals.items():
            layer.get_submodule(name).weight = original


def reference_error(entries: list[dict[str, Any]]) -> float:
    """The measured error of a module's reference candidate (every role at the rung)."""
    name = reference_profile()
    for entry in entries:
        if all(p == name for p in entry["profiles"].values()):
            return float(entry["err"])
    raise ValueError(f"the measurement has no candidate with every linear at {name}")


def sensitivity_record(
    measurement: dict[str, Any], probe: SensitivityProbe, costs: list[float]
) -> list[dict[str, dict[str, float]]]:
    """Per layer, per module: {"kl": the branch's cost, "err": its reference error}."""
    out: list[dict[str, dict[str, float]]] = [{} for _ in measurement["layers"]]
    for (i, kind), kl in zip(probe.branches, costs, strict=True):
        out[i][kind] = {"kl": kl, "err": reference_error(measurement["layers"][i][kind])}
    return out


def module_weights(sensitivity: list[dict[str, dict[str, float]]]) -> list[dict[str, float]]:
    """Per layer, per module: w = KL / err_ref², floored at WEIGHT_FLOOR × the median w."""
    raw = [
        {kind: v["kl"] / max(v["err"], 1e-12) ** 2 for kind, v in layer.items()}
        for layer in sensitivity
    ]
    values = sorted(w for layer in raw for w in layer.values())
    if not values:
        return raw
    floor = WEIGHT_FLOOR * values[len(values) // 2]
    return [{kind: max(w, floor) for kind, w in layer.items()} for layer in raw]
