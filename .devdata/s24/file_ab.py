"""Issue 28, session 24: decode-graph A/B of one source file's two versions on the 8B
random-weight models of tools/bench.py, batch 1 (.devdata/s22/warm_ab.py's `measure` at
PROMPT tokens). Each version runs in its own process (the file is swapped in between),
alternating A / B / A / B per format; logits compared with A's first run.
    python .devdata/s24/file_ab.py OUT_JSON FILE A_COPY PROMPT [formats...]
A_COPY: the A version of FILE (e.g. from `git show REV:FILE`); B is FILE as checked out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, torch
sys.path.insert(0, ".devdata/s22")
from pathlib import Path
from warm_ab import measure
from tools.bench import build_model
fmt, rows_out, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3])
path = build_model(Path("/tmp/kestrel-bench") / f"llama3-8b-{fmt}", "llama3-8b", fmt)
m = measure(path, prompt)
torch.save({"tokens": m["tokens"], "rows": m["rows"].cpu()}, rows_out)
print(json.dumps({"step_ms": m["step_ms"], "replay_ms": m["replay_ms"]}))
"""


def main() -> int:
    out, target, a_copy, prompt = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    formats = sys.argv[5:] or ["gptq"]
    b_copy = Path("/tmp/file_ab_b.py")
    shutil.copy(target, b_copy)
    import torch

    result: dict = {"gpu": torch.cuda.get_device_name(), "file": str(target), "prompt": prompt}
    try:
        for fmt in formats:
            ref = None
            for i, name in enumerate(["A", "B", "A", "B"][: int(os.environ.get("RUNS", 4))]):
                shutil.copy(a_copy if name == "A" else b_copy, target)
                rows_out = f"/tmp/rows-{fmt}-{i}.pt"
                p = subprocess.run(
                    [sys.executable, "-c", CHILD, fmt, rows_out, prompt],
                    capture_output=True, text=True, timeout=400,
                )  # fmt: skip
                if p.returncode != 0:
                    print(p.stderr[-3000:], flush=True)
                    result[f"{fmt}/{name}/{i}"] = {"error": p.stderr[-1500:]}
                    continue
                m = json.loads(p.stdout.strip().splitlines()[-1])
                r = torch.load(rows_out)
                ref = ref or r
                m["tokens_equal_A"] = r["tokens"] == ref["tokens"]
                if not m["tokens_equal_A"]:
                    # Where the greedy tokens part, and how far apart A's and this run's two
                    # candidates were at that step (logits, fp32).
                    pairs = zip(ref["tokens"], r["tokens"], strict=True)
                    first = next(j for j, (a, b) in enumerate(pairs) if a != b)
                    m["first_differing_step"] = first
                    for tag, run in (("A", ref), ("this", r)):
                        row = run["rows"][first].float()
                        m[f"candidates_{tag}"] = {
                            str(t): float(row[t])
                            for t in (ref["tokens"][first], r["tokens"][first])
                        }
                    prev = (ref["rows"][:first].float() - r["rows"][:first].float()).abs()
                    m["max_abs_logit_diff_before"] = float(prev.max()) if first else 0.0
                diff = (r["rows"].float() - ref["rows"].float()).abs().max()
                m["max_abs_logit_diff_vs_A"] = float(diff)
                m["tok_s_replay"] = 1e3 / m["replay_ms"]
                result[f"{fmt}/{name}/{i}"] = m
                print(f"{fmt}/{name}/{i}", json.dumps(m), flush=True)
                out.write_text(json.dumps(result, indent=1))
    finally:
        shutil.copy(b_copy, target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
