"""Issue 28, session 23: the leaner decode GEMV loop (whole-chunk and whole-tile launches
without masks, x read once per chunk in 8-byte words, one shift per word, one product chain
per column) against main's GEMV (.devdata/s23/gemv_main.py), on the 8B random-weight
models of tools/bench.py, batch 1, P512. Each variant runs in its own process (the kernel
file is swapped in between), alternating main / lean twice per format; measured as
.devdata/s22/warm_ab.py's `measure`. Logits of each run are compared with the first run of
the same variant (bitwise) and with main's (max abs difference).
    python .devdata/s23/lean_ab.py OUT_JSON [formats...]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

GEMV = Path("kernels/quant_matmul/gemv.py")
MAIN = Path(".devdata/s23/gemv_main.py")

CHILD = r"""
import json, sys, torch
sys.path.insert(0, ".devdata/s22")
from pathlib import Path
from warm_ab import measure
from tools.bench import build_model
fmt, rows_out = sys.argv[1], sys.argv[2]
path = build_model(Path("/tmp/kestrel-bench") / f"llama3-8b-{fmt}", "llama3-8b", fmt)
m = measure(path)
torch.save({"tokens": m["tokens"], "rows": m["rows"].cpu()}, rows_out)
print(json.dumps({"step_ms": m["step_ms"], "replay_ms": m["replay_ms"]}))
"""


def main() -> int:
    out = Path(sys.argv[1])
    formats = sys.argv[2:] or ["gptq", "exl2"]
    lean = Path("/tmp/gemv_lean.py")
    shutil.copy(GEMV, lean)
    import torch

    result: dict = {"gpu": torch.cuda.get_device_name()}
    try:
        for fmt in formats:
            first: dict[str, dict] = {}
            for i, variant in enumerate(["main", "lean", "main", "lean"]):
                shutil.copy(MAIN if variant == "main" else lean, GEMV)
                rows_out = f"/tmp/rows-{fmt}-{i}.pt"
                p = subprocess.run(
                    [sys.executable, "-c", CHILD, fmt, rows_out],
                    capture_output=True, text=True, timeout=400,
                )
                if p.returncode != 0:
                    print(p.stderr[-3000:], flush=True)
                    result[f"{fmt}/{variant}/{i}"] = {"error": p.stderr[-1500:]}
                    continue
                m = json.loads(p.stdout.strip().splitlines()[-1])
                r = torch.load(rows_out)
                ref = first.setdefault(variant, r)
                main_ref = first.get("main", r)
                m["same_bits_as_variant_first"] = r["tokens"] == ref["tokens"] and torch.equal(
                    r["rows"], ref["rows"]
                )
                m["tokens_equal_main"] = r["tokens"] == main_ref["tokens"]
                m["max_abs_logit_diff_vs_main"] = float(
                    (r["rows"].float() - main_ref["rows"].float()).abs().max()
                )
                m["tok_s_replay"] = 1e3 / m["replay_ms"]
                result[f"{fmt}/{variant}/{i}"] = m
                print(f"{fmt}/{variant}/{i}", json.dumps(m), flush=True)
                out.write_text(json.dumps(result, indent=1))
    finally:
        shutil.copy(lean, GEMV)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
