"""Token-mask time per decode step on this CPU, for N constrained rows like the bench's.

tools/bench.py --constrained runs 64 jobs, 32 of them under a JSON schema (an array of 64
or more tool calls, tools/bench_constrained.py); each step the host fills the 32 rows'
masks while the GPU runs the forward, and the step waits for the slower of the two. This
tool measures the host half alone, with the real tokenizer and no model:

- N rows, each a job under that schema, step together for --steps tokens; each row's next
  token is drawn at random among the tokens its mask allows (seeded), as the random-weight
  bench model's greedy choice among allowed tokens would be. An episode is one such run
  of new jobs; episodes repeat with the compiled grammars kept, as in a server.
- Variants run in lockstep on the same tokens, their order alternating every step, so a
  loaded machine slows them alike; their masks must be equal (a mismatch is an error):
  - `before`: the engine as it was: every job a copy of one prototype matcher (llguidance's
    `deep_copy` shares the prototype's lexer, behind one lock), llguidance's default
    slices, all rows filled by one `fill_next_token_bitmask_par` call on an LLExecutor,
    then a per-row emptiness check;
  - `before_serial`: the same, its rows filled one after another on the calling thread
    (the old path without the executor's threads);
  - `slices`: the engine's `compile_constraint` + `mask_logits` with one mask lane (finer
    string-length slices only);
  - `after`: the same with --lanes lanes (engine/constraints/lanes.py).
- Per step: the time of each variant's mask fill (the engine's whole `mask_logits` hook,
  less the GPU's apply), mean, median and p90 in ms, for the first (cold) episode and the
  rest (warm); and `consume`, the time the rows' matchers take the drawn tokens (the
  scheduler's `sync_constraint`, on its own thread), over all episodes.

    python3 tools/bench_masks.py --tokenizer .whl/llama3-tok --rows 32 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import llguidance.torch
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.constraints import ConstraintSpec, compile_constraint, mask_logits  # noqa: E402
from engine.constraints.compiler import ll_tokenizer  # noqa: E402
from engine.constraints.lanes import mask_lanes, set_mask_lanes  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from tools.bench_constrained import long_schema  # noqa: E402

VARIANTS = ("before", "before_serial", "slices", "after")


class _Job:
    """What the engine's hooks read of a job: its constraint."""

    def __init__(self, constraint: Any) -> None:
        self.constraint = constraint


class _Before:
    """The previous engine's mask path (kept here only as the benchmark's baseline)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab: int, spec: ConstraintSpec, serial: bool = False
    ) -> None:
        self.serial = serial
        wrapper = ll_tokenizer(tokenizer, vocab)  # the engine's vocabulary table...
        self.ll_tok = wrapper.with_slices(llguidance.LLTokenizer.general_slices())  # ...as was
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            spec.text, defaults={"whitespace_flexible": False}
        )
        self.prototype = llguidance.LLMatcher(self.ll_tok, grammar, log_level=0)
        self.executor = llguidance.LLExecutor()
        self.words = (vocab + 31) // 32
        self.matchers: list[llguidance.LLMatcher] = []
        self.host = torch.full((1, self.words), -1, dtype=torch.int32)

    def new_episode(self, rows: int) -> None:
        self.matchers = [self.prototype.deep_copy() for _ in range(rows)]
        self.host = torch.full((rows, self.words), -1, dtype=torch.int32)

    def fill(self) -> torch.Tensor:
        if self.serial:
            for i, matcher in enumerate(self.matchers):
                llguidance.torch.fill_next_token_bitmask(matcher, self.host, i)
        else:
            pairs = [(m, i) for i, m in enumerate(self.matchers)]
            llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, self.host)
        for i, matcher in enumerate(self.matchers):
            if matcher.is_error() or not bool(self.host[i].any()):
                raise RuntimeError(f"row {i}: the grammar allows no token")
        torch.tensor(list(range(len(self.matchers))), dtype=torch.int64)  # the row index
        return self.host

    def consume(self, tokens: list[int]) -> None:
        for matcher, token in zip(self.matchers, tokens, strict=True):
            if not matcher.consume_token(token):
                raise RuntimeError(f"token {token} refused: {matcher.get_error()}")


class _Engine:
    """The engine's path: compile_constraint per job, mask_logits per step."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, spec: ConstraintSpec, lanes: int):
        self.tokenizer, self.vocab, self.spec, self.lanes = tokenizer, vocab, spec, lanes
        self.jobs: list[_Job] = []
        self.generated: list[list[int]] = []
        self.logits = torch.empty(0, vocab, device="meta")  # shapes only: no apply here
        self.got = torch.empty(0)

    def new_episode(self, rows: int) -> None:
        set_mask_lanes(self.lanes)
        try:
            self.jobs = [
                _Job(compile_constraint(self.spec, self.tokenizer, self.vocab)) for _ in range(rows)
            ]
        finally:
            set_mask_lanes(None)
        self.generated = [[] for _ in range(rows)]
        self.logits = torch.empty(rows, self.vocab, device="meta")

    def _keep(self, logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.got = mask
        return logits

    def fill(self) -> torch.Tensor:
        mask_logits([(job, n, ()) for n, job in enumerate(self.jobs)], self.logits, self._keep)
        failed = [n for n, job in enumerate(self.jobs) if job.constraint.failed]
        if failed:
            raise RuntimeError(f"rows {failed}: {self.jobs[failed[0]].constraint.failed}")
        return self.got

    def consume(self, tokens: list[int]) -> None:
        for job, generated, token in zip(self.jobs, self.generated, tokens, strict=True):
            generated.append(token)
            job.constraint.sync(generated)
            if job.constraint.failed:
                raise RuntimeError(job.constraint.failed)


def _draw(mask: torch.Tensor, vocab: int, rng: random.Random) -> list[int]:
    """A random allowed token per row of the bitmask."""
    bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    tokens = []
    for row in bits:
        allowed = np.flatnonzero(row)
        tokens.append(int(allowed[rng.randrange(len(allowed))]))
    return tokens


def _summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in seconds)
    return {
        "mean_ms": round(statistics.mean(ms), 3),
        "median_ms": round(statistics.median(ms), 3),
        "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3),
    }


def bench_masks(
    tokenizer_dir: Path,
    rows: int = 32,
    steps: int = 128,
    episodes: int = 4,
    lanes: int | None = None,
    seed: int = 0,
    variants: tuple[str, ...] = VARIANTS,
) -> dict[str, Any]:
    """Per-step mask times of `variants` (see the module docstring), lockstep on one
    token stream; raises if their masks ever differ."""
    lanes = lanes or mask_lanes()
    spec = ConstraintSpec("json_schema", json.dumps(long_schema()), "json_schema")
    runners: dict[str, Any] = {}
    for name in variants:
        # A tokenizer object per variant: the engine caches grammars per tokenizer, and the
        # variants must not warm each other's lexers.
        tokenizer = Tokenizer.from_dir(tokenizer_dir)
        vocab = tokenizer.vocab_size
        if name in ("before", "before_serial"):
            runners[name] = _Before(tokenizer, vocab, spec, serial=name == "before_serial")
        elif name in ("slices", "after"):
            runners[name] = _Engine(tokenizer, vocab, spec, 1 if name == "slices" else lanes)
        else:
            raise ValueError(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}")
    times: dict[str, list[list[float]]] = {name: [] for name in variants}
    syncs: dict[str, list[float]] = {name: [] for name in variants}
    rng = random.Random(seed)
    for _ in range(episodes):
        for name, runner in runners.items():
            runner.new_episode(rows)
            times[name].append([])
        for step in range(steps):
            order = list(variants) if step % 2 == 0 else list(reversed(variants))
            masks: dict[str, torch.Tensor] = {}
            for name in order:
                start = time.perf_counter()
                mask = runners[name].fill()
                times[name][-1].append(time.perf_counter() - start)
                masks[name] = mask.clone()  # the engine reuses its buffer
            first = masks[variants[0]]
            for name in variants[1:]:
                if not torch.equal(masks[name], first):
                    raise RuntimeError(f"step {step}: {name}'s masks differ from {variants[0]}'s")
            tokens = _draw(first, vocab, rng)
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.consume(tokens)
                syncs[name].append(time.perf_counter() - start)
    result: dict[str, Any] = {
        "tokenizer": str(tokenizer_dir),
        "vocab": vocab,
        "rows": rows,
        "steps": steps,
        "episodes": episodes,
        "lanes": lanes,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
    }
    for name in variants:
        result[name] = {"cold": _summary(times[name][0])}
        if episodes > 1:
            result[name]["warm"] = _summary([t for ep in times[name][1:] for t in ep])
        result[name]["consume"] = _summary(syncs[name])
    return result


def _print(result: dict[str, Any], out: Callable[[str], None] = print) -> None:
    out(
        f"{result['rows']} rows x {result['steps']} steps x {result['episodes']} episodes, "
        f"vocab {result['vocab']}, {result['lanes']} lanes, {result['cpus']} CPUs, "
        f"load average {result['load_average']:.1f}"
    )
    for name in VARIANTS:
        if name in result:
            for phase, stats in result[name].items():
                out(
                    f"  {name:13s} {phase}: mean {stats['mean_ms']:.2f} ms/step, "
                    f"median {stats['median_ms']:.2f}, p90 {stats['p90_ms']:.2f}"
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokenizer", type=Path, required=True,
        help="a directory with tokenizer.json (e.g. Llama-3's, from tools/rank_tokenizer.py)",
    )  # fmt: skip
    parser.add_argument("--rows", type=int, default=32, help="constrained rows per step")
    parser.add_argument("--steps", type=int, default=128, help="tokens per episode")
    parser.add_argument("--episodes", type=int, default=4, help="episodes (the first is cold)")
    parser.add_argument(
        "--lanes", type=int, default=None,
        help="mask lanes of the `after` variant (default: the engine's, by CPU count)",
    )  # fmt: skip
    parser.add_argument(
        "--variants", default=",".join(VARIANTS),
        help=f"comma-separated, from {', '.join(VARIANTS)}",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    if not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    if args.rows < 1 or args.steps < 1 or args.episodes < 1:
        parser.error("--rows, --steps and --episodes must be at least 1")
    result = bench_masks(
        args.tokenizer,
        rows=args.rows,
        steps=args.steps,
        episodes=args.episodes,
        lanes=args.lanes,
        seed=args.seed,
        variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()),
    )
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
