"""Issue 28, session 24: decode-graph A/B of GEMV launch settings (GemvConfig) on the 8B
random-weight models of tools/bench.py, batch 1, P512. Each setting runs in its own
process, alternating A / B / A / B per format; measured as .devdata/s22/warm_ab.py's
`measure`. Logits of each run are compared with A's first (bitwise, and max abs diff).
    python .devdata/s24/config_ab.py OUT_JSON 'A_JSON' 'B_JSON' [formats...]
A_JSON / B_JSON: GemvConfig fields to replace in the default ('{}' is the default).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import dataclasses, json, sys, torch
sys.path.insert(0, ".devdata/s22")
from pathlib import Path
from kernels.quant_matmul import gemv
fields = json.loads(sys.argv[3])
if "cols_per_thread" in fields:
    fields["cols_per_thread"] = tuple(fields["cols_per_thread"])
gemv._GEMV_CONFIG = dataclasses.replace(gemv._GEMV_CONFIG, **fields)
from warm_ab import measure
from tools.bench import build_model
fmt, rows_out = sys.argv[1], sys.argv[2]
path = build_model(Path("/tmp/kestrel-bench") / f"llama3-8b-{fmt}", "llama3-8b", fmt)
m = measure(path)
torch.save({"tokens": m["tokens"], "rows": m["rows"].cpu()}, rows_out)
print(json.dumps({"step_ms": m["step_ms"], "replay_ms": m["replay_ms"],
                  "config": str(gemv._GEMV_CONFIG)}))
"""


def main() -> int:
    out = Path(sys.argv[1])
    variants = {"A": sys.argv[2], "B": sys.argv[3]}
    formats = sys.argv[4:] or ["gptq", "exl2"]
    import torch

    result: dict = {"gpu": torch.cuda.get_device_name(), "variants": variants}
    for fmt in formats:
        ref = None
        for i, name in enumerate(["A", "B", "A", "B"]):
            rows_out = f"/tmp/rows-{fmt}-{i}.pt"
            p = subprocess.run(
                [sys.executable, "-c", CHILD, fmt, rows_out, variants[name]],
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
            m["same_bits_as_A"] = m["tokens_equal_A"] and torch.equal(r["rows"], ref["rows"])
            diff = (r["rows"].float() - ref["rows"].float()).abs().max()
            m["max_abs_logit_diff_vs_A"] = float(diff)
            m["tok_s_replay"] = 1e3 / m["replay_ms"]
            result[f"{fmt}/{name}/{i}"] = m
            print(f"{fmt}/{name}/{i}", json.dumps(m), flush=True)
            out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
