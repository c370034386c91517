"""Constrained decoding speed (tools/bench.py --constrained): a grammar-constrained job
against an unconstrained one at batch 1, and 64 jobs half constrained against 64 free.

The random-weight bench model gets a real tokenizer for this (a JSON grammar over t0..tN
words has nothing to write): `--tokenizer DIR` holds tokenizer.json and
tokenizer_config.json, e.g. Llama-3's 128k vocabulary written by tools/rank_tokenizer.py.
The weights are hard-linked next to it. The constraint is a JSON schema that cannot end
within the measured tokens (an array of tool-call objects with many items), so every step
of the constrained job computes and applies a mask; EOS is banned on the free jobs.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine.engine import Engine, EngineOptions

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "data" / "constrained"
NEW_TOKENS = 128


def with_tokenizer(model: Path, tokenizer: Path) -> Path:
    """`model`'s weights and config with `tokenizer`'s files, in a sibling directory."""
    target = model.with_name(f"{model.name}-{tokenizer.name}")
    if not (target / "tokenizer.json").is_file():
        target.mkdir(parents=True, exist_ok=True)
        for item in model.iterdir():
            if item.name.startswith("tokenizer"):
                continue
            if not (target / item.name).exists():
                try:
                    os.link(item, target / item.name)
                except OSError:
                    shutil.copy(item, target / item.name)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / name, target / name)
    _special_ids_from_tokenizer(target)
    return target


def _special_ids_from_tokenizer(model: Path) -> None:
    """The config's BOS/EOS ids made the tokenizer's: the random model names ids 0 and 1,
    ordinary tokens (`!` and `"`) in a real vocabulary, and a grammar that allows `"` would
    then end the job there (seen on an H100: 6 tokens instead of 128)."""
    ids = {
        t["content"]: t["id"]
        for t in json.loads((model / "tokenizer.json").read_text())["added_tokens"]
    }
    names = json.loads((model / "tokenizer_config.json").read_text())
    config_path = model / "config.json"
    config = json.loads(config_path.read_text())
    config["bos_token_id"] = ids[names["bos_token"]]
    config["eos_token_id"] = ids[names["eos_token"]]
    config_path.unlink()  # a hard link to the bench model's own config: write a new file
    config_path.write_text(json.dumps(config, indent=2))


def long_schema() -> dict[str, Any]:
    """Tool calls, 64 or more of them: far more than NEW_TOKENS tokens to write."""
    tools = json.loads((SCHEMAS / "tool_schemas.json").read_text())
    return {
        "type": "array",
        "items": {"anyOf": list(tools.values())},
        "minItems": 64,
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _stream_tok_s(engine: Engine, jobs: list[Any]) -> tuple[float, int]:
    _sync()
    start = time.perf_counter()
    events = list(engine.scheduler.stream_many(jobs))
    _sync()
    seconds = time.perf_counter() - start
    # A job that ended early (a stop token, a grammar error) would make the ratios compare
    # unlike work: every job must write all its tokens.
    short = [
        (job.id, job.finish_reason, len(job.generated_ids))
        for job in jobs
        if job.finish_reason != "length"
    ]
    if short:
        raise RuntimeError(f"jobs ended before max_new_tokens (id, reason, tokens): {short}")
    return seconds, sum(len(e.token_ids) for e in events)


def bench_constrained(
    model: Path,
    tokenizer: Path,
    prompt_len: int = 128,
    *,
    new_tokens: int = NEW_TOKENS,
    jobs: int = 64,
    device: str = "cuda",
) -> dict[str, Any]:
    """Batch 1 (median of 5 after 2 warm-ups) and `jobs` concurrent jobs, half of them
    constrained, against as many free ones (median of 3 after 1)."""
    path = with_tokenizer(model, tokenizer)
    per_job = prompt_len + new_tokens
    engine = Engine.load(
        path,
        EngineOptions(
            device=device, dtype="float16" if device == "cuda" else "float32",
            max_seq_len=per_job + 16, cache_tokens=jobs * (per_job + 256), max_batch=jobs,
            prefix_caching=False,
        ),
    )  # fmt: skip
    vocab = engine.tokenizer.vocab_size
    free = {"max_new_tokens": new_tokens, "temperature": 0, "ban_eos_token": True}
    # EOS banned on both (the grammar cannot end within the run anyway).
    constrained = {**free, "json_schema": long_schema()}
    text = "Write the tool calls for a busy day of errands, meetings, travel and shopping. "
    base = engine.tokenizer.encode(text * (prompt_len // 16 + 1), add_bos=True)[:prompt_len]

    def prompt(i: int) -> list[int]:
        return base[:-1] + [100 + i % (vocab - 200)]  # distinct jobs, the same length

    def batch1(settings: dict) -> float:
        runs = []
        for n in range(7):
            job = engine.scheduler.submit(prompt(n), settings)
            seconds, tokens = _stream_tok_s(engine, [job])
            runs.append(tokens / seconds)
        return statistics.median(runs[2:])

    def mixed(n_constrained: int) -> float:
        runs = []
        for _ in range(4):
            submitted = [
                engine.scheduler.submit(prompt(i), constrained if i < n_constrained else free)
                for i in range(jobs)
            ]
            seconds, tokens = _stream_tok_s(engine, submitted)
            runs.append(tokens / seconds)
        return statistics.median(runs[1:])

    result: dict[str, Any] = {
        "tokenizer": str(tokenizer),
        "vocab": engine.config.vocab_size,
        "prompt": prompt_len,
        "new_tokens": new_tokens,
        "jobs": jobs,
        "batch1_free_tok_s": batch1(free),
        "batch1_constrained_tok_s": batch1(constrained),
        "jobs64_free_tok_s": mixed(0),
        "jobs64_half_constrained_tok_s": mixed(jobs // 2),
    }
    result["batch1_ratio"] = result["batch1_constrained_tok_s"] / result["batch1_free_tok_s"]
    result["jobs64_ratio"] = result["jobs64_half_constrained_tok_s"] / result["jobs64_free_tok_s"]
    result["scheduler"] = engine.scheduler.stats()
    engine.unload()
    return result
