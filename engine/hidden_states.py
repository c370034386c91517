"""Final hidden states of whole sequences (what embeddings pool), many at a time.

Inputs are packed in order into forwards of at most `prefill_chunk` tokens, so many short
texts (a document's passages) share one forward instead of one each; an input longer than
a chunk runs alone, chunk by chunk over its cache pages. Nothing stays cached. The model's
default LoRA selection applies, as for `Engine.logits`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cache import ForwardBatch, Sequence

if TYPE_CHECKING:
    from engine.engine import Engine


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


def _forward(engine: Engine, sequences: list[Sequence], tokens: list[list[int]]) -> torch.Tensor:
    """Hidden states [sum of lengths, width] (float32, CPU) of one forward."""
    lengths = [len(t) for t in tokens]
    scales = engine.loras.scales([engine.loras.default] * len(sequences))
    lora_batch = None if scales is None else engine.loras.batch(scales, lengths, lengths)
    batch = ForwardBatch.build(engine.cache, sequences, tokens, all_logits=True)
    with engine.loras.active(lora_batch):
        return engine.model.hidden_states(batch, engine.cache).float().cpu()


def hidden_states_many(engine: Engine, inputs: list[list[int]]) -> list[torch.Tensor]:
    """[len(ids), width] per input, in order (see the module docstring). The engine lock is
    taken per forward group, so that generation steps interleave with a long batch."""
    for ids in inputs:
        engine.check_length(len(ids))
    chunk = engine.options.prefill_chunk
    lengths = [len(ids) for ids in inputs]
    out: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    start = 0
    while start < len(inputs):
        with engine.lock:
            cache = engine.cache
            group = next_group(lengths, start, chunk, cache.page_size, cache.free_pages)
            sequences = [Sequence() for _ in group]
            try:
                if len(group) == 1:
                    ids = inputs[start]
                    parts = [
                        _forward(engine, sequences, [ids[at : at + chunk]])
                        for at in range(0, len(ids), chunk)
                    ]
                    out[start] = torch.cat(parts)
                else:
                    tokens = [inputs[i] for i in group]
                    rows = _forward(engine, sequences, tokens)
                    for i, part in zip(group, rows.split([len(t) for t in tokens]), strict=True):
                        out[i] = part
            finally:
                for seq in sequences:
                    seq.release(cache)
        start = group[-1] + 1
    return out
