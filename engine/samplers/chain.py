"""How `engine.sampling.Sampler` decides which steps run, and what a step is given.

`active_steps` picks the samplers the settings turn on, in `sampler_priority` order, with
TGW's two special cases (greedy keeps only the penalties; nothing runs after mirostat).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from engine.samplers.order import PROCESSORS
from engine.samplers.penalties import token_counts
from engine.sampling_settings import SamplingSettings


def active_steps(settings: SamplingSettings) -> tuple[str, ...]:
    """The samplers (TGW names) a Sampler with these settings applies, in order."""
    s = settings
    on = {
        "repetition_penalty": s.repetition_penalty != 1.0,
        "presence_penalty": s.presence_penalty != 0.0,
        "frequency_penalty": s.frequency_penalty != 0.0,
        "dry": s.dry_multiplier > 0.0,
        "top_n_sigma": s.top_n_sigma > 0.0,
        "temperature": s.temperature != 1.0,
        "dynamic_temperature": s.dynamic_temperature,
        "quadratic_sampling": s.smoothing_factor > 0.0,
        "top_k": s.top_k > 0,
        "top_p": s.top_p < 1.0,
        "typical_p": s.typical_p < 1.0,
        "epsilon_cutoff": s.epsilon_cutoff > 0.0,
        "eta_cutoff": s.eta_cutoff > 0.0,
        "tfs": s.tfs < 1.0,
        "top_a": s.top_a > 0.0,
        "min_p": s.min_p > 0.0,
        "mirostat": s.mirostat_mode == 2,
        "xtc": s.xtc_probability > 0.0,
        "no_repeat_ngram": s.no_repeat_ngram_size > 0,
    }
    steps = [n for n in s.order if on[n] and (not s.greedy or n in PROCESSORS)]
    if "mirostat" in steps:
        # TGW's mirostat draws the token itself; what follows sees only that token.
        steps = steps[: steps.index("mirostat") + 1]
    return tuple(steps)


@dataclass
class VocabTensors:
    """What the per-token steps need for one vocabulary size, built once on the device."""

    bias: Tensor | None
    ban: Tensor | None
    eos: Tensor
    xtc_protected: Tensor


class StepContext:
    """One call's context ids [B, L], with the token counts the three penalties share."""

    def __init__(self, context_ids: Tensor, vocab_size: int, rep_range: int) -> None:
        self.context_ids = context_ids
        self.vocab_size = vocab_size
        self.rep_range = rep_range
        self._counts: Tensor | None = None

    def counts(self) -> Tensor:
        if self._counts is None:
            self._counts = token_counts(self.context_ids, self.vocab_size, self.rep_range)
        return self._counts

    def recent(self, last_n: int) -> Tensor:
        return self.context_ids[:, -last_n:] if last_n > 0 else self.context_ids
