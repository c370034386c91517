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
        # Each row copied out at once: on a GPU the session's logits can be a view of a
        # buffer the next step writes again (a CUDA graph's output), so rows kept as
        # returned all read the last step's values.
        logits = session.prefill(prompt).float().cpu().clone()
        rows, tokens = [logits], []
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = session.step(tokens[-1]).float().cpu().clone()
            rows.append(logits)
    finally:
        session.close()
    return tokens, torch.stack(rows)
