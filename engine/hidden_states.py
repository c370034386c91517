"""Final hidden states of whole sequences (what embeddings pool), many at a time.

Inputs are packed in order into forwards of at most `prefill_chunk` tokens, so many short
texts (a document's passages) share one forward instead of one each; an input longer than
a chunk runs alone, chunk by chunk over its cache pages. Nothing stays cached. The model's
default LoRA selection applies, as for `Engine.logits`. Each forward is a `StepPlan` with
`hidden_states` set, run by the scheduler between its steps (`Scheduler.execute_now`).
"""

from __future__ import annotations

import torch

from engine.pages import PagePool, Sequence
from engine.scheduler import Scheduler
from engine.step import StepPlan


def next_group(
    lengths: list[int], start: int, budget: int, page_size: int, free_pages: int
) -> list[int]:
    """Indices start, start + 1, ... of the inputs that share the next forward: at most
    `budget` tokens, and their sequences' pages (whole pages each) within `free_pages`. The
    input at `start` always goes (alone if it passes either limit, as `Engine.logits` would
    run it)."""
    group = [start]
    tokens, pages = lengths[start], -(-lengths[start] // page_size)
    for i in range(start + 1, len(lengths)):
        need = -(-lengths[i] // page_size)
        if tokens + lengths[i] > budget or pages + need > free_pages:
            break
        group.append(i)
        tokens, pages = tokens + lengths[i], pages + need
    return group


def _forward(
    scheduler: Scheduler, sequences: list[Sequence], tokens: list[list[int]]
) -> torch.Tensor:
    """Hidden states [sum of lengths, width] (float32, CPU) of one forward."""
    plan = StepPlan(sequences, tokens, loras=[{} for _ in tokens], hidden_states=True)
    return scheduler.execute_now(plan).values


def hidden_states_many(
    scheduler: Scheduler, pages: PagePool, inputs: list[list[int]], chunk: int
) -> list[torch.Tensor]:
    """[len(ids), width] per input, in order (see the module docstring); `chunk` tokens
    per forward at most. The scheduler's lock is taken per forward group, so that
    generation steps interleave with a long batch."""
    lengths = [len(ids) for ids in inputs]
    out: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    start = 0
    while start < len(inputs):
        with scheduler.lock:
            group = next_group(lengths, start, chunk, pages.page_size, pages.free_pages)
            sequences = [Sequence() for _ in group]
            try:
                if len(group) == 1:
                    ids = inputs[start]
                    parts = [
                        _forward(scheduler, sequences, [ids[at : at + chunk]])
                        for at in range(0, len(ids), chunk)
                    ]
                    out[start] = torch.cat(parts)
                else:
                    tokens = [inputs[i] for i in group]
                    rows = _forward(scheduler, sequences, tokens)
                    for i, part in zip(group, rows.split([len(t) for t in tokens]), strict=True):
                        out[i] = part
            finally:
                for seq in sequences:
                    seq.release(pages)
        start = group[-1] + 1
    return out
