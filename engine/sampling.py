"""Token sampling: one `Sampler` per job, built from its `SamplingSettings`.

Contract:
- `Sampler(settings, device=..., eos_token_ids=..., encode=...)` takes the settings in any
  form `SamplingSettings.from_any` accepts. `encode` maps text to token ids without BOS
  (e.g. `lambda s: tokenizer.encode(s, add_bos=False)`); it turns DRY's sequence breakers
  into ids (the last id of "a" + breaker, as TGW does) and finds the newline id XTC
  protects. Without it DRY runs without breakers (with a warning) and XTC protects EOS only.
- `sampler.seed` is the seed in use: the one asked for, or for seed -1 one drawn once from
  os.urandom, so that a run can be reported and repeated. Each sampler owns a
  `torch.Generator` on its device: draws depend only on the seed and the calls made to
  this sampler, never on global RNG state.
- `sample(logits[V], context_ids[L]) -> int`, `sample_batch(logits[B, V], context_ids[B, L])
  -> Tensor[B]` and `sample_with_scores(...) -> (tokens[B], scores[B, V])`. Logits must be
  on the sampler's device. `context_ids` are the tokens the penalties look at (prompt and
  generated so far, as TGW does); in a batch, rows are left-padded with -1 so the last
  column is every row's newest token. Rows are independent sequences advanced in lockstep.
- State per job: `generated` counts the calls that drew tokens (min_new_tokens compares
  it; `generated_count=`, an int or a [B] tensor, overrides it for a call) and
  `mirostat_mu` holds mirostat's mu per row (created on the first draw; the batch size
  may not change afterwards).
- `process(...)` returns the logits the draw uses: their softmax is the distribution
  (for logprobs). It changes no state, but flips XTC's coin from the generator when XTC
  is on; `sample_with_scores` returns the scores of the draw itself.

Order (TGW semantics; see engine/samplers/order.py):
    1. logit_bias, then custom_token_bans, ban_eos_token and min_new_tokens (EOS banned
       until that many tokens were generated): TGW runs these unsorted processors first;
    2. the active samplers in `sampler_priority` order (TGW's default: repetition,
       presence and frequency penalties over the last repetition_penalty_range tokens,
       DRY, top_n_sigma, temperature, dynamic temperature, quadratic sampling, top_k,
       top_p, typical_p, epsilon/eta cutoff, tfs, top_a, min_p, mirostat, XTC,
       no_repeat_ngram), temperature_last moving the three temperature steps last;
    3. a draw from softmax of what is left (-inf entries have probability 0).
  Greedy settings (do_sample False or temperature 0) apply step 1 and the penalties of
  step 2 (repetition/presence/frequency, DRY, no_repeat_ngram) and take the argmax, as
  transformers skips its warpers when not sampling. With mirostat, TGW draws inside the
  mirostat step and later steps see only the drawn token, so they are left out here and
  the draw is taken from mirostat's truncation. When the steps leave a row without any
  token (no_repeat_ngram after top_k 1 can), that row takes the most likely token step 1
  allows, where TGW would fail.

Host syncs: none per step in `process`, `sample_batch` or `sample_with_scores`, for every
setting (mirostat's mu and the min_new_tokens mask stay on the device, the draw avoids
torch.multinomial's checks). `sample` returns an int and so waits for the device; a
context given as a Python list is copied to the device on each call (pass a tensor).
Banned strings are the generator's job: it must rewind emitted text, which a sampler
cannot (engine/banned_strings.py). `generator.sample_jobs` draws rows whose settings
use only temperature/top_k/top_p/min_p (and bias/bans) together, as tensor ops with a
parameter column per setting (engine/samplers/batched.py), with the same tokens.
The step functions (`apply_*`) are public, work on [B, V] logits and never modify
their input.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from engine.samplers.bias import (
    apply_ban,
    apply_logit_bias,
    ban_mask,
    bias_vector,
    min_new_tokens_mask,
)
from engine.samplers.chain import StepContext, VocabTensors, active_steps
from engine.samplers.order import PROCESSORS
from engine.samplers.penalties import (
    apply_dry,
    apply_frequency_penalty,
    apply_no_repeat_ngram,
    apply_presence_frequency_penalty,
    apply_presence_penalty,
    apply_repetition_penalty,
    token_counts,
)
from engine.samplers.stochastic import apply_mirostat_v2, apply_xtc, draw, mirostat_v2_update
from engine.samplers.temperature import (
    apply_dynamic_temperature,
    apply_quadratic_sampling,
    apply_temperature,
)
from engine.samplers.truncation import (
    apply_epsilon_cutoff,
    apply_eta_cutoff,
    apply_min_p,
    apply_tfs,
    apply_top_a,
    apply_top_k,
    apply_top_n_sigma,
    apply_top_p,
    apply_typical_p,
)
from engine.sampling_settings import SamplingSettings, SamplingSettingsError, sampler_order

__all__ = [
    "Sampler",
    "SamplingSettings",
    "SamplingSettingsError",
    "active_steps",
    "apply_dry",
    "apply_dynamic_temperature",
    "apply_epsilon_cutoff",
    "apply_eta_cutoff",
    "apply_frequency_penalty",
    "apply_min_p",
    "apply_mirostat_v2",
    "apply_no_repeat_ngram",
    "apply_presence_frequency_penalty",
    "apply_presence_penalty",
    "apply_quadratic_sampling",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_tfs",
    "apply_top_a",
    "apply_top_k",
    "apply_top_n_sigma",
    "apply_top_p",
    "apply_typical_p",
    "apply_xtc",
    "sampler_order",
    "token_counts",
]

Encode = Callable[[str], Sequence[int]]


class Sampler:
    """One job's sampler: its settings, seeded generator and state (see the module doc)."""

    def __init__(
        self,
        settings: SamplingSettings | Mapping[str, Any] | None = None,
        *,
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[int] = (),
        encode: Encode | None = None,
    ) -> None:
        self.settings = SamplingSettings.from_any(settings)
        self.device = torch.device(device)
        if str(self.device) == "cuda":  # no index given
            # torch.device("cuda") != torch.device("cuda:0"): pin it so the device check
            # in process compares like with like.
            self.device = torch.device("cuda", torch.cuda.current_device())
        if any(int(i) < 0 for i in eos_token_ids):
            raise ValueError(f"eos_token_ids must be >= 0, got {list(eos_token_ids)}")
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        s = self.settings
        # 31 bits as TGW draws them: the seed stays exact when a browser shows it.
        self.seed = s.seed if s.seed >= 0 else int.from_bytes(os.urandom(4), "little") >> 1
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)
        self.steps = active_steps(s)
        self.generated = 0
        self.mirostat_mu: Tensor | None = None
        self._by_vocab: dict[int, VocabTensors] = {}
        breakers = self._breaker_ids(encode) if "dry" in self.steps else []
        self._breakers = torch.tensor(breakers, dtype=torch.int64, device=self.device)
        newline = _last_id(encode, "\n") if encode is not None else None
        self._xtc_protected = [*self.eos_token_ids, *([newline] if newline is not None else [])]
        self._dry_range = (
            s.repetition_penalty_range if s.dry_penalty_last_n < 0 else (s.dry_penalty_last_n)
        )
        self._fns: dict[str, Callable[[Tensor, StepContext], Tensor]] = {
            "repetition_penalty": lambda x, c: apply_repetition_penalty(
                x, c.counts(), s.repetition_penalty
            ),
            "presence_penalty": lambda x, c: apply_presence_penalty(
                x, c.counts(), s.presence_penalty
            ),
            "frequency_penalty": lambda x, c: apply_frequency_penalty(
                x, c.counts(), s.frequency_penalty
            ),
            "dry": lambda x, c: apply_dry(
                x,
                c.recent(self._dry_range),
                s.dry_multiplier,
                s.dry_base,
                s.dry_allowed_length,
                self._breakers,
            ),
            "top_n_sigma": lambda x, c: apply_top_n_sigma(x, s.top_n_sigma),
            "temperature": lambda x, c: apply_temperature(x, s.temperature),
            "dynamic_temperature": lambda x, c: apply_dynamic_temperature(
                x, s.dynatemp_low, s.dynatemp_high, s.dynatemp_exponent
            ),
            "quadratic_sampling": lambda x, c: apply_quadratic_sampling(
                x, s.smoothing_factor, s.smoothing_curve
            ),
            "top_k": lambda x, c: apply_top_k(x, s.top_k),
            "top_p": lambda x, c: apply_top_p(x, s.top_p),
            "typical_p": lambda x, c: apply_typical_p(x, s.typical_p),
            # TGW's units: the slider value times 1e-4.
            "epsilon_cutoff": lambda x, c: apply_epsilon_cutoff(x, s.epsilon_cutoff * 1e-4),
            "eta_cutoff": lambda x, c: apply_eta_cutoff(x, s.eta_cutoff * 1e-4),
            "tfs": lambda x, c: apply_tfs(x, s.tfs),
            "top_a": lambda x, c: apply_top_a(x, s.top_a),
            "min_p": lambda x, c: apply_min_p(x, s.min_p),
            "mirostat": lambda x, c: apply_mirostat_v2(x, self._mu(x.shape[0])),
            "xtc": self._xtc,
            "no_repeat_ngram": lambda x, c: apply_no_repeat_ngram(
                x, c.context_ids, s.no_repeat_ngram_size
            ),
        }

    @property
    def greedy(self) -> bool:
        return self.settings.greedy

    def process(
        self,
        logits: Tensor,
        context_ids: Tensor | Sequence[int] | Sequence[Sequence[int]],
        *,
        generated_count: int | Tensor | None = None,
    ) -> Tensor:
        """Logits [B, V] (or [V]) after every active step: the distribution drawn from."""
        one_row = logits.dim() == 1
        scores, _ = self._run(
            logits.unsqueeze(0) if one_row else logits, context_ids, generated_count
        )
        return scores.squeeze(0) if one_row else scores

    def distribution(
        self,
        logits: Tensor,
        context_ids: Tensor | Sequence[Sequence[int]],
        *,
        generated_count: int | Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(scores [B, V] after every step, logits after the bias and bans only): what a
        draw would use, without drawing. Speculative verification needs both: the scores'
        softmax is the target distribution, and a row the steps emptied falls back to the
        argmax of the second, as `sample_with_scores` does."""
        return self._run(logits, context_ids, generated_count)

    def sample_with_scores(
        self,
        logits: Tensor,
        context_ids: Tensor | Sequence[Sequence[int]],
        *,
        generated_count: int | Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One token per row (int64 [B]) and the scores [B, V] it was drawn from.

        Advances `generated` and mirostat's state; no host sync.
        """
        scores, allowed = self._run(logits, context_ids, generated_count)
        tokens = scores.argmax(dim=-1) if self.greedy else draw(scores, self.generator)
        # A row the steps emptied takes the best token the bans allow (see module doc).
        empty = torch.isneginf(scores).all(dim=-1)
        tokens = torch.where(empty, allowed.argmax(dim=-1), tokens)
        if "mirostat" in self.steps:
            s = self.settings
            mu = self._mu(scores.shape[0])
            updated = mirostat_v2_update(mu, scores, tokens, s.mirostat_tau, s.mirostat_eta)
            self.mirostat_mu = torch.where(empty, mu, updated)
        self.generated += 1
        return tokens, scores

    def sample_batch(
        self,
        logits: Tensor,
        context_ids: Tensor | Sequence[Sequence[int]],
        *,
        generated_count: int | Tensor | None = None,
    ) -> Tensor:
        """One token per row: logits [B, V], context_ids [B, L] left-padded with -1.

        Returns int64 [B] on the logits' device, without a host sync.
        """
        return self.sample_with_scores(logits, context_ids, generated_count=generated_count)[0]

    def sample(
        self,
        logits: Tensor,
        context_ids: Tensor | Sequence[int],
        *,
        generated_count: int | None = None,
    ) -> int:
        """One token from logits [V] given the context [L].

        generated_count: tokens this job has generated so far, for min_new_tokens; by
        default the number of draws this sampler has made.
        """
        if logits.dim() != 1:
            raise ValueError(f"sample takes logits [V], got {list(logits.shape)}")
        ctx = torch.as_tensor(context_ids, dtype=torch.int64, device=logits.device)
        tokens = self.sample_batch(
            logits.unsqueeze(0), ctx.reshape(1, -1), generated_count=generated_count
        )
        return int(tokens[0])

    def _run(
        self,
        logits: Tensor,
        context_ids: Tensor | Sequence[Any],
        generated_count: int | Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """(scores after all steps, logits after the bias and bans only)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got {list(logits.shape)}")
        if logits.device != self.device:
            raise ValueError(f"logits are on {logits.device}, the sampler on {self.device}")
        logits = logits.float()
        batch, vocab = logits.shape
        ctx = torch.as_tensor(context_ids, dtype=torch.int64, device=logits.device)
        ctx = ctx.reshape(batch, -1 if ctx.numel() else 0)
        s = self.settings
        per_vocab = self._vocab_tensors(vocab)

        if per_vocab.bias is not None:
            logits = apply_logit_bias(logits, per_vocab.bias)
        if per_vocab.ban is not None:
            logits = apply_ban(logits, per_vocab.ban)
        if s.min_new_tokens > 0 and self.eos_token_ids:
            count = self.generated if generated_count is None else generated_count
            if isinstance(count, Tensor):
                count = count.to(device=logits.device).reshape(-1).expand(batch)
                mask = min_new_tokens_mask(per_vocab.eos, count, s.min_new_tokens)
                logits = apply_ban(logits, mask)
            elif count < s.min_new_tokens:
                logits = apply_ban(logits, per_vocab.eos)
        allowed = logits

        call = StepContext(ctx, vocab, s.repetition_penalty_range)
        for name in self.steps:
            if name in PROCESSORS and ctx.shape[1] == 0:
                continue  # nothing to penalize yet
            logits = self._fns[name](logits, call)
        return logits, allowed

    def _xtc(self, logits: Tensor, call: StepContext) -> Tensor:
        s = self.settings
        # One coin per row from the sampler's generator, kept on the device.
        coin = (
            torch.rand(logits.shape[0], generator=self.generator, device=logits.device)
            < s.xtc_probability
        )
        protected = self._vocab_tensors(logits.shape[-1]).xtc_protected
        return apply_xtc(logits, s.xtc_threshold, coin, protected)

    def _mu(self, batch: int) -> Tensor:
        """Mirostat's mu per row; stored only by a draw, so `process` changes no state."""
        if self.mirostat_mu is None:
            # Mirostat starts at twice the target surprise, as TGW and the paper do.
            return torch.full((batch,), 2.0 * self.settings.mirostat_tau, device=self.device)
        if self.mirostat_mu.shape[0] != batch:
            raise ValueError(
                f"mirostat keeps state for {self.mirostat_mu.shape[0]} rows; "
                f"this call has {batch} (use one Sampler per batch shape)"
            )
        return self.mirostat_mu

    def _vocab_tensors(self, vocab: int) -> VocabTensors:
        # Ids beyond the lm_head cannot be sampled anyway, so they need no bias or ban.
        if vocab not in self._by_vocab:
            s = self.settings
            banned = list(s.custom_token_bans)
            if s.ban_eos_token:
                banned += self.eos_token_ids
            protected = [i for i in self._xtc_protected if i < vocab]
            self._by_vocab[vocab] = VocabTensors(
                bias=bias_vector(s.logit_bias, vocab, self.device) if s.logit_bias else None,
                ban=ban_mask(banned, vocab, self.device) if banned else None,
                eos=ban_mask(self.eos_token_ids, vocab, self.device),
                xtc_protected=torch.tensor(protected, dtype=torch.int64, device=self.device),
            )
        return self._by_vocab[vocab]

    def _breaker_ids(self, encode: Encode | None) -> list[int]:
        strings = self.settings.dry_sequence_breakers
        if encode is None:
            if strings:
                warnings.warn(
                    "DRY is on but the Sampler got no `encode` function: its sequence "
                    f"breakers {strings!r} are ignored",
                    stacklevel=3,
                )
            return []
        # TGW encodes "a" + breaker and takes the last id: the breaker as it is tokenized
        # after other text, not at the start where tokenizers add a space marker.
        ids = (_last_id(encode, "a" + b) for b in strings)
        return sorted({i for i in ids if i is not None})


def _last_id(encode: Encode, text: str) -> int | None:
    ids = list(encode(text))
    return int(ids[-1]) if ids else None
