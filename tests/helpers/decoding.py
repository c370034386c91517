"""Helpers for tests that compare what two engines decode."""

from __future__ import annotations

import torch

from engine.engine import Engine


def greedy_with_logits(
    engine: Engine, prompt: list[int], steps: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of `steps` decode steps after `prompt`, and the logits of the prompt's
    last row and of every step (float32, on the CPU)."""
    session = engine.open_session()
    try:
        logits = session.prefill(prompt)
        rows, tokens = [logits], []
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = session.step(tokens[-1])
            rows.append(logits)
    finally:
        session.close()
    return tokens, torch.stack(rows).float().cpu()
