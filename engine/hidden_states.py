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


def pack(lengths: list[int], budget: int, page_size: int, free_pages: int) -> list[list[int]]:
    """Indices of `lengths` in order, grouped so that a group holds at most `budget` tokens
    and its sequences' pages fit `free_pages` (each sequence takes whole pages); an item
    past either limit is a group of its own (it runs alone, as `Engine.logits` would)."""
    groups: list[list[int]] = []
    tokens = pages = 0
    for i, n in enumerate(lengths):
        need = -(-n // page_size)
        if groups and tokens + n <= budget and pages + need <= free_pages:
            groups[-1].append(i)
            tokens, pages = tokens + n, pages + need
        else:
            groups.append([i])
            tokens, pages = n, need
    return groups


def _forward(engine: Engine, sequences: list[Sequence], tokens: list[list[int]]) -> torch.Tensor:
    """Hidden states [sum of lengths, width] (float32, CPU) of one forward."""
    lengths = [len(t) for t in tokens]
    scales = engine.loras.scales([engine.loras.default] * len(sequences))
    lora_batch = None if scales is None else engine.loras.batch(scales, lengths, lengths)
    batch = ForwardBatch.build(engine.cache, sequences, tokens, all_logits=True)
    with engine.loras.active(lora_batch):
        return engine.model.hidden_states(batch, engine.cache).float().cpu()


def hidden_states_many(engine: Engine, inputs: list[list[int]]) -> list[torch.Tensor]:
    """[len(ids), width] per input, in order (see the module docstring)."""
    for ids in inputs:
        engine.check_length(len(ids))
    chunk = engine.options.prefill_chunk
    out: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    with engine.lock:
        lengths = [len(ids) for ids in inputs]
        cache = engine.cache
        for group in pack(lengths, chunk, cache.page_size, cache.free_pages):
            sequences = [Sequence() for _ in group]
            try:
                if len(group) == 1:
                    ids = inputs[group[0]]
                    parts = [
                        _forward(engine, sequences, [ids[start : start + chunk]])
                        for start in range(0, len(ids), chunk)
                    ]
                    out[group[0]] = torch.cat(parts)
                else:
                    tokens = [inputs[i] for i in group]
                    rows = _forward(engine, sequences, tokens)
                    for i, part in zip(group, rows.split([len(t) for t in tokens]), strict=True):
                        out[i] = part
            finally:
                for seq in sequences:
                    seq.release(engine.cache)
    return out
