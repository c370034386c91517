"""Issue 28, session 22: the fold's MLP inputs in their weights' row order (engine/norm_fold.py
input_row_order) A/B on the 8B random-weight EXL2 model (every weight has a perm), batch 1,
P512, alternating off/on twice; GPTQ (no perm: nothing changes) once as a control.
Measured as .devdata/s22/warm_ab.py's `measure` (fresh Engine.load per variant, greedy 48
tokens + logits compared bitwise with the first variant, scheduler step, graph replay).
    python .devdata/s22/order_ab.py OUT_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, ".devdata/s22")
import torch  # noqa: E402
from warm_ab import measure  # noqa: E402

from engine import norm_fold  # noqa: E402
from tools.bench import build_model  # noqa: E402


def main() -> int:
    out = Path(sys.argv[1])
    result: dict = {"gpu": torch.cuda.get_device_name()}
    runs = [("exl2", False), ("exl2", True), ("exl2", False), ("exl2", True), ("gptq", True)]
    refs: dict[str, dict] = {}
    for i, (fmt, enabled) in enumerate(runs):
        path = build_model(Path("/tmp/kestrel-bench") / f"llama3-8b-{fmt}", "llama3-8b", fmt)
        norm_fold.set_input_row_order(enabled)
        try:
            m = measure(path)
        finally:
            norm_fold.set_input_row_order(True)
        ref = refs.setdefault(fmt, m)
        same = m["tokens"] == ref["tokens"] and torch.equal(m["rows"], ref["rows"])
        name = f"{fmt}/{'row_order' if enabled else 'gather'}/{i}"
        result[name] = {
            "step_ms": m["step_ms"],
            "replay_ms": m["replay_ms"],
            "tok_s_replay": 1e3 / m["replay_ms"],
            "same_bits_as_first": same,
        }
        print(
            f"{name:22s} step {m['step_ms']:.3f} ms  replay {m['replay_ms']:.3f} ms "
            f"({1e3 / m['replay_ms']:.1f} tok/s)  same bits {same}",
            flush=True,
        )
        out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
