"""One batched draw for the common stochastic settings: temperature, top_k, top_p, min_p
(and logit_bias, banned tokens, min_new_tokens), each row with its own values.

`engine.sampling.Sampler` runs one job's chain on its rows; a batch of B jobs with
different settings then costs B chains of small kernels. Rows whose active steps are a
subset of the four above (in TGW's order, temperature first or last) are instead drawn
here together: every step is one tensor op over [B, V] with a per-row parameter column,
and a row without a step gets the step's neutral mask. Each row keeps its own generator
(its seed): its exponential noise is drawn from it exactly as `draw` does, so a row gets
the very token its own Sampler would give. Greedy rows whose only settings are a logit
bias, banned tokens (ban_eos_token) or min_new_tokens join too: they take the argmax after
the bias and bans and draw no noise. Per row, the chain costs about eight small kernels,
so 64 such jobs spent more host time per step than the GPU's whole decode step.
Everything else (penalties, DRY, mirostat's state, XTC's coin, typical_p and the other
rarer steps) stays on the per-row path.

No host sync: parameters are built on the host from the settings and copied from pinned
memory without waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from engine.sampling import Sampler

_NEG_INF = float("-inf")
TRUNCATIONS = ("top_k", "top_p", "min_p")


# Each row's argmax, int64 [N], as torch's argmax gives it: the runner's (engine/step.py
# `Runner.greedy_tokens`, a kernel on a GPU) where the scheduler draws; torch's elsewhere.
Argmax = Callable[[Tensor], Tensor]


def torch_argmax(logits: Tensor) -> Tensor:
    return logits.argmax(dim=-1)


def batchable(sampler: Sampler) -> bool:
    """Whether `sample_batched` draws exactly what `sampler.sample_batch` would."""
    steps = sampler.steps
    if sampler.greedy:
        # Greedy keeps only context processors (penalties, DRY, ...) as steps.
        return not steps
    rest = tuple(n for n in steps if n != "temperature")
    if rest != tuple(n for n in TRUNCATIONS if n in rest):
        return False
    return "temperature" not in steps or steps[0] == "temperature" or steps[-1] == "temperature"


def host_to_device(values: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on `device` without waiting: a plain copy to a GPU synchronizes
    the stream, one from pinned memory with non_blocking does not."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def _column(values: list[float], device: torch.device) -> Tensor:
    return host_to_device(torch.tensor(values, dtype=torch.float32), device).view(-1, 1)


def _flags(values: list[bool], device: torch.device) -> Tensor:
    return host_to_device(torch.tensor(values), device).view(-1, 1)


def sample_batched(
    samplers: list[Sampler], logits: Tensor, argmax: Argmax = torch_argmax
) -> Tensor:
    """One token per row of logits [B, V], row i drawn by samplers[i] (all `batchable`).
    `argmax` takes the best allowed token and, where a row draws, the noisy draw's argmax;
    it must give exactly torch's argmax (first index on ties, NaN above all). torch's
    reduces a row of a 128k vocabulary in one thread block, 29 us of an 8B decode step on an
    H200, and a job with ban_eos_token or a temperature comes here, not to the plain greedy
    path.

    Advances each sampler's `generated` count, as its own `sample_batch` would."""
    device = logits.device
    batch, vocab = logits.shape
    x = logits.float()
    settings = [s.settings for s in samplers]
    tables = [s._vocab_tensors(vocab) for s in samplers]  # noqa: SLF001 - same package's cache
    if any(t.bias is not None for t in tables):
        zero = torch.zeros(vocab, device=device)
        x = x + torch.stack([t.bias if t.bias is not None else zero for t in tables])
    bans = []
    for sampler, table in zip(samplers, tables, strict=True):
        row = table.ban if table.ban is not None else torch.zeros_like(table.eos)
        s = sampler.settings
        if s.min_new_tokens > 0 and sampler.eos_token_ids and sampler.generated < s.min_new_tokens:
            row = row | table.eos
        bans.append(row)
    x = x.masked_fill(torch.stack(bans), _NEG_INF)
    allowed = x

    pairs = list(zip(settings, samplers, strict=True))
    temps = [s.temperature if "temperature" in p.steps else 1.0 for s, p in pairs]
    first = [p.steps[:1] == ("temperature",) for p in samplers]
    if any(first):
        x = x / _column([t if f else 1.0 for t, f in zip(temps, first, strict=True)], device)
    if any("top_k" in p.steps for p in samplers):
        k = torch.tensor([s.top_k if "top_k" in p.steps else vocab for s, p in pairs]).clamp(
            max=vocab
        )
        ordered = x.sort(dim=-1, descending=True).values
        kth = ordered.gather(-1, host_to_device(k - 1, device).view(-1, 1))
        x = x.masked_fill(x < kth, _NEG_INF)
    if any("top_p" in p.steps for p in samplers):
        on = _flags(["top_p" in p.steps for p in samplers], device)
        # Same arithmetic as apply_top_p (a float32 threshold per row).
        floor = _column([1 - s.top_p for s in settings], device)
        sorted_logits, sorted_idx = torch.sort(x, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= floor
        sorted_remove[..., -1] = False
        remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)
        x = x.masked_fill(remove & on, _NEG_INF)
    if any("min_p" in p.steps for p in samplers):
        on = _flags(["min_p" in p.steps for p in samplers], device)
        probs = x.softmax(dim=-1)
        remove = probs < _column([s.min_p for s in settings], device) * probs.amax(
            dim=-1, keepdim=True
        )
        x = x.masked_fill(remove & on, _NEG_INF)
    last = [("temperature" in p.steps) and not f for p, f in zip(samplers, first, strict=True)]
    if any(last):
        x = x / _column([t if f else 1.0 for t, f in zip(temps, last, strict=True)], device)

    greedy = [p.greedy for p in samplers]
    best_allowed = argmax(allowed)
    if all(greedy):
        tokens = best_allowed  # what a greedy row's chain (no steps) takes, empty or not
    else:
        probs = x.softmax(dim=-1)
        noise = torch.ones_like(probs)
        for index, sampler in enumerate(samplers):
            # Row by row from each job's own generator: the draws `draw` would make for it
            # (greedy rows draw nothing, as their own Sampler does not).
            if not sampler.greedy:
                noise[index].exponential_(1.0, generator=sampler.generator)
        tokens = argmax(probs / noise)
        # Rows the steps emptied, and greedy rows, take the best token the bans allow.
        take_best = torch.isneginf(x).all(dim=-1)
        if any(greedy):
            take_best = take_best | _flags(greedy, device).view(-1)
        tokens = torch.where(take_best, best_allowed, tokens)
    for sampler in samplers:
        sampler.generated += 1
    return tokens
