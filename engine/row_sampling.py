"""Sampling a step's rows: the tokens each job of a step gets from the step's logits.

Used by the scheduler's `update` (engine/scheduler.py): `sample_rows` for a normal step
(plain rows drawn together, speculative rows verified), `draw_rows` for a step whose
tokens stay on the device (the lookahead). Per-job constraints on the next token are
gathered in one place, `constraints`, and masked out of the logits
(`generator.apply_position_bans`, inside `draw_jobs` / `sample_jobs` / `verify`) before
any sampler step sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.constraints import ApplyMask, mask_logits
from engine.generator import (
    TokenLogprob,
    TokenReadback,
    draw_jobs,
    logprob_entries,
    sample_jobs,
    token_logprobs,
)
from engine.jobs import DECODE, GENERATE, Drawn, Job, Row
from engine.samplers.batched import Argmax, host_to_device, torch_argmax
from engine.speculative import verify

RowTokens = tuple[list[int], list[TokenLogprob | None]]  # a row's new tokens, their logprobs


@dataclass
class SampleCounts:
    """What one step's sampling adds to the scheduler's stats."""

    decode_rows: int = 0  # rows of decoding jobs, and the tokens they produced
    decode_tokens: int = 0
    drafted: int = 0  # drafts verified, and how many of them were accepted
    accepted: int = 0


def constraints(job: Job, positions: int = 1) -> list[list[int]]:
    """The tokens `job` must not draw at its next `positions` generated positions (one,
    or a draft row's k + 1): the one place where per-job constraints on sampling are
    gathered: banned strings' rewinds (grammar masks are applied to the logits before,
    by `mask_logits`)."""
    start = len(job.generated_ids)
    return [job.bans.at(start + j) for j in range(positions)]


def draw_rows(
    jobs: list[Job], logits: torch.Tensor, apply_mask: ApplyMask, argmax: Argmax = torch_argmax
) -> Drawn:
    """One token per job (logits [len(jobs), vocab]) on the device, no host sync; their
    copy to the host starts now, ahead of whatever is queued next. `apply_mask` and
    `argmax`: the runner's, for the grammar masks of constrained jobs and every argmax of
    the draw (plain greedy rows, the batched draw's)."""
    logits = mask_logits([(job, n, ()) for n, job in enumerate(jobs)], logits, apply_mask)
    bans = [constraints(job)[0] for job in jobs]
    tokens = draw_jobs([job.sampling for job in jobs], logits, bans if any(bans) else None, argmax)
    return Drawn(jobs, tokens, TokenReadback(tokens))


def sample_rows(
    rows: list[Row], logits: torch.Tensor, apply_mask: ApplyMask, argmax: Argmax = torch_argmax
) -> tuple[list[RowTokens], SampleCounts]:
    """New tokens (and logprobs) per row: none for a prefill chunk that does not reach
    the end or a logits job, one for a plain row, the accepted drafts and one more for a
    draft row (whose job's sampler and draft counts advance by them)."""
    counts = SampleCounts()
    starts = [0]
    for row in rows:
        starts.append(starts[-1] + min(row.logits_wanted, len(row.feed) + len(row.drafts)))
    plain = [
        n
        for n, row in enumerate(rows)
        if row.job.kind == GENERATE
        and not row.drafts
        and row.job.sequence.length == len(row.job.tokens)
    ]
    results: list[RowTokens] = [([], []) for _ in rows]
    # Grammar masks of constrained rows (computed on the host while the forward ran, see
    # engine/constraints/hooks.py), on every row that draws a token.
    logits = mask_logits(
        [(rows[n].job, starts[n + 1] - 1, ()) for n in plain]
        + [(row.job, starts[n], row.drafts) for n, row in enumerate(rows) if row.drafts],
        logits,
        apply_mask,
    )
    if plain:
        rows_at = torch.tensor([starts[n + 1] - 1 for n in plain])
        index = host_to_device(rows_at, logits.device)
        jobs = [rows[n].job for n in plain]
        bans = [constraints(job)[0] for job in jobs]
        tokens, logprobs = sample_jobs(
            [job.sampling for job in jobs], logits[index], bans if any(bans) else None, argmax
        )
        for n, token, lp in zip(plain, tokens, logprobs, strict=True):
            results[n] = ([token], [lp[0] if lp else None])
        decoding = sum(rows[n].job.state == DECODE for n in plain)
        counts.decode_rows += decoding
        counts.decode_tokens += decoding
    verified = []
    for n, row in enumerate(rows):
        if row.drafts:
            job = row.job
            bans = constraints(job, len(row.drafts) + 1)
            block = logits[starts[n] : starts[n + 1]]
            verified.append((n, block, verify(job.sampling, block, row.drafts, bans)))
    if verified:
        flat = torch.stack([torch.stack(pair) for _, _, pair in verified]).tolist()
        for (n, block, _), (accepted, token) in zip(verified, flat, strict=True):
            row, job = rows[n], rows[n].job
            tokens = row.drafts[:accepted] + [token]
            job.sampling.sampler.generated += len(tokens)
            job.sampling.append(host_to_device(torch.tensor(tokens), logits.device))
            lps: list[TokenLogprob | None] = [None] * len(tokens)
            if job.sampling.logprobs_k is not None:
                k = job.sampling.logprobs_k
                ids = torch.tensor(tokens, device=logits.device)
                chosen, values, top = token_logprobs(block[: len(tokens)], ids, k)
                lps = list(logprob_entries(tokens, chosen.tolist(), values.tolist(), top.tolist()))
            results[n] = (tokens, lps)
            job.draft_tokens += len(row.drafts)
            job.accepted_tokens += accepted
            counts.drafted += len(row.drafts)
            counts.accepted += accepted
            counts.decode_rows += 1
            counts.decode_tokens += len(tokens)
    return results, counts
