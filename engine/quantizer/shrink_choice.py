"""GPTQ's Hessian shrinkage, chosen per model on calibration rows GPTQ never saw.

    rows = heldout_row_count(rows, length)          # how many rows to hold out
    shrink = next_shrink(trials)                    # the next rung to try, or None: done
    best = best_shrink(trials)                      # the rung with the lowest held-out loss
    loss = heldout_loss(lm, states, head_weight, token_ids)

Why per model: shrinking H toward its diagonal (gptq.py) keeps GPTQ from leaning on input
correlations that one text has and others lack. On one H200 with the shared English text
(64 x 2048 rows, bench/results/2026-11-29-h200-quant-shrink-s25.json) 0.3 took
SmolLM2-135M at 3.0 bpw from 112.4 to 100.6 multilingual perplexity and lowered every
other domain, while Gemma-3-270M at 3.0 lost 3-24% on every domain. In both models the
held-out encyclopedia text moved the way most other domains did, so the choice is made on
rows of the user's own text that the Hessians do not contain.

Contract:
- Rungs are tried up SHRINK_LADDER: the first two always, each later one only while the
  rung before it lowered the held-out loss below every rung before that (the loss is about
  unimodal in the shrinkage: more of it trades the calibration text's fit for
  generality). So a conversion makes two or three quantizing passes.
- `best_shrink` breaks ties toward less shrinkage (plain GPTQ on a tie); a loss that is
  not finite counts as the worst.
- `heldout_row_count` holds out an eighth of the quantizing rows, and at least
  MIN_HELDOUT_TOKENS tokens: the rungs' losses differ by about a percent, which a few
  thousand tokens resolve as a paired comparison (the same tokens under each rung). A text
  that leaves fewer than half of MIN_HELDOUT_TOKENS is quantized at 0 (pipeline.py).
- `heldout_loss` is the mean next-token negative log-likelihood in nats of `token_ids`
  [R, L] given the final hidden states [R, L, hidden] after the quantized layers, through
  the final norm (float32) and the quantized head's dequantized weight, with the model's
  final logit soft-cap where it has one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.quantizer.model import LayerwiseModel
from kernels.rms_norm import rms_norm_reference

SHRINK_LADDER = (0.0, 0.3, 1.0)
MIN_HELDOUT_TOKENS = 4096
HELDOUT_FRACTION = 8  # one row in this many is held out beside the quantizing rows
_HEAD_TOKENS = 512  # tokens per head matmul: [512, vocab] float32 logits at a time


def heldout_row_count(rows: int, length: int) -> int:
    """Rows to hold out beside `rows` quantizing rows of `length` tokens."""
    return max(math.ceil(rows / HELDOUT_FRACTION), math.ceil(MIN_HELDOUT_TOKENS / length))


def next_shrink(trials: dict[float, float]) -> float | None:
    """The next rung of SHRINK_LADDER to try given held-out losses so far, or None."""
    for i, rung in enumerate(SHRINK_LADDER):
        if rung in trials:
            continue
        if i < 2:
            return rung
        last = trials[SHRINK_LADDER[i - 1]]
        before = min(trials[r] for r in SHRINK_LADDER[: i - 1])
        return rung if last < before else None
    return None


def best_shrink(trials: dict[float, float]) -> float:
    """The tried rung with the lowest loss (the smallest shrinkage on a tie; a loss that is
    not finite, from a pass whose held-out states overflowed, loses to any finite one)."""
    if not trials:
        raise ValueError("no shrinkage was tried")
    return min(sorted(trials), key=lambda s: trials[s] if math.isfinite(trials[s]) else math.inf)


@torch.inference_mode()
def heldout_loss(
    lm: LayerwiseModel, states: torch.Tensor, head_weight: torch.Tensor, token_ids: torch.Tensor
) -> float:
    """Mean next-token NLL (nats) of `token_ids` [R, L] from `states` [R, L, hidden]."""
    if states.shape[:2] != token_ids.shape or token_ids.shape[1] < 2:
        raise ValueError(
            f"held-out states {tuple(states.shape)} do not match token rows "
            f"{tuple(token_ids.shape)} of at least 2 tokens"
        )
    norm = lm.final_norm()
    cap = getattr(lm.model, "final_logit_softcap", None)
    weight = head_weight.to(lm.device, torch.float32)
    total, count = 0.0, 0
    for r in range(states.shape[0]):
        x = states[r, :-1]
        targets = token_ids[r, 1:].to(lm.device)
        for start in range(0, x.shape[0], _HEAD_TOKENS):
            part = slice(start, min(x.shape[0], start + _HEAD_TOKENS))
            h = rms_norm_reference(
                x[part].to(lm.device, torch.float32),
                norm.weight.float(),
                norm.eps,
                unit_offset=norm.unit_offset,
            )
            logits = F.linear(h, weight)
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
            nll = torch.logsumexp(logits, dim=-1) - logits.gather(
                -1, targets[part].unsqueeze(-1)
            ).squeeze(-1)
            total += float(nll.double().sum())
            count += int(nll.numel())
    return total / count
