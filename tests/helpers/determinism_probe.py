"""Decode one model in this process and save what came out, for tests/engine/test_determinism.py.

    python -m tests.helpers.determinism_probe MODEL_DIR OUT.pt [--device cuda]   # from the root

Saves a dict: "greedy_logits" (batch 1 through a decode session: the prompt's last row and
every step's logits, float32), and per batch of the scheduler ("batch1", "batch8") each
job's token ids and the log-probabilities of its chosen and top-20 tokens, for greedy and
seeded-sampling jobs mixed in one continuous batch. Each run is a fresh process, so
anything kept between calls (compiled kernels, graphs, workspaces) starts anew.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engine.engine import Engine, EngineOptions

from .decoding import greedy_with_logits

STEPS = 32


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(2, 4096, (24 + 7 * i,), generator=gen).tolist() for i in range(count)]


def settings(index: int) -> dict:
    """Even jobs greedy, odd ones sampled with their own seed: both kinds in one batch."""
    common = {"max_new_tokens": STEPS, "logprobs": 20, "ban_eos_token": True}
    if index % 2 == 0:
        return {**common, "temperature": 0.0}
    return {**common, "temperature": 0.9, "top_p": 0.95, "seed": 1000 + index}


def run_batch(engine: Engine, count: int) -> list[dict]:
    jobs = [engine.scheduler.submit(p, settings(i)) for i, p in enumerate(prompts(count))]
    out = {job.id: {"ids": [], "chosen": [], "top": []} for job in jobs}
    for event in engine.scheduler.stream_many(jobs):
        record = out[event.job_id]
        record["ids"] += event.token_ids
        for lp in event.logprobs or []:
            record["chosen"].append(lp.logprob)
            record["top"].append(list(lp.top))
    return [out[job.id] for job in jobs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    options = EngineOptions(
        device=args.device,
        dtype="float16",
        max_seq_len=512,
        cache_tokens=8 * 512,
    )
    engine = Engine.load(args.model, options)
    try:
        _, logits = greedy_with_logits(engine, prompts(1)[0], STEPS)
        result = {
            "greedy_logits": logits,
            "batch1": run_batch(engine, 1),
            "batch8": run_batch(engine, 8),
        }
    finally:
        engine.unload()
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
