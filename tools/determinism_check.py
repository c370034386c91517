"""Is GPU decode bitwise reproducible? Repeat the same greedy decode and compare its logits.

    python tools/determinism_check.py --shape tiny --format gptq --runs 20 --json OUT.json

For each setting of programmatic dependent launch (off, on), loads the model once and runs
the same prompt `--runs` times through fresh decode sessions (CUDA graphs replayed, as in
serving), then reports how many runs gave logits bit-identical to the first, the largest
difference, and the first step whose greedy token differed. A kernel that races, or a
reduction whose order depends on timing, shows here (issue 31); run it under
`compute-sanitizer --tool racecheck|synccheck` with `--runs 1 --steps 4` to look for races.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kernels.backend as backend
from engine.engine import Engine, EngineOptions
from tests.helpers.decoding import greedy_with_logits
from tools.bench import SHAPES, build_model


def check(path: Path, pdl: bool, runs: int, steps: int, prompt_len: int, graphs: bool) -> dict:
    backend.set_programmatic_launch(pdl)
    engine = Engine.load(
        path,
        EngineOptions(device="cuda", dtype="float16", max_seq_len=prompt_len + steps + 8,
                      cuda_graphs=graphs),
    )  # fmt: skip
    try:
        gen = torch.Generator().manual_seed(3)
        vocab = engine.config.vocab_size
        prompt = torch.randint(2, vocab, (prompt_len,), generator=gen).tolist()
        first_tokens, first_rows = greedy_with_logits(engine, prompt, steps)
        same, max_diff, token_flips = 1, 0.0, []
        for _ in range(runs - 1):
            tokens, rows = greedy_with_logits(engine, prompt, steps)
            if torch.equal(rows, first_rows):
                same += 1
            else:
                max_diff = max(max_diff, float((rows - first_rows).abs().max()))
            pairs = enumerate(zip(tokens, first_tokens, strict=True))
            flip = next((i for i, (a, b) in pairs if a != b), None)
            if flip is not None:
                token_flips.append(flip)
    finally:
        engine.unload()
    return {
        "pdl": pdl,
        "graphs": graphs,
        "runs": runs,
        "bit_identical_runs": same,
        "max_abs_logit_diff": max_diff,
        "runs_with_other_tokens": len(token_flips),
        "first_token_flip_steps": token_flips[:10],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny", choices=list(SHAPES))
    parser.add_argument("--format", default="gptq", choices=["gptq", "exl2"])
    parser.add_argument("--work", default="/tmp/kestrel-bench")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--pdl", choices=["off", "on", "both"], default="both")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    path = build_model(Path(args.work) / f"{args.shape}-{args.format}", args.shape, args.format)
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.pdl]
    results = {
        "gpu": torch.cuda.get_device_name(),
        "shape": args.shape,
        "format": args.format,
        "checks": [
            check(path, pdl, args.runs, args.steps, args.prompt, not args.no_graphs)
            for pdl in settings
        ],
    }
    for c in results["checks"]:
        print(
            f"{args.shape} {args.format} pdl={c['pdl']}: "
            f"{c['bit_identical_runs']}/{c['runs']} "
            f"bit-identical, max |diff| {c['max_abs_logit_diff']:.3g}, "
            f"{c['runs_with_other_tokens']} runs with other tokens"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
