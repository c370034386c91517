"""Issue 28, session 24: greedy decoding on the 8B GPTQ random-weight model (CUDA graph
for PROMPT + 512 keys) with each step's logits cloned at once; checks that every row's
argmax is the token taken, then (second argument given) compares with an earlier run's
file: where the tokens part and both runs' logits of the two candidates there.
    python .devdata/s24/greedy_check.py OUT_PT PROMPT [EARLIER_PT]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from engine.engine import Engine, EngineOptions
from tools.bench import build_model

out, prompt_len = sys.argv[1], int(sys.argv[2])
path = build_model(Path("/tmp/kestrel-bench") / "llama3-8b-gptq", "llama3-8b", "gptq")
engine = Engine.load(
    path, EngineOptions(device="cuda", dtype="float16", max_seq_len=prompt_len + 512)
)
g = torch.Generator().manual_seed(7)
prompt = torch.randint(2, engine.config.vocab_size, (64,), generator=g).tolist()
session = engine.open_session()
logits = session.prefill(prompt).float().cpu().clone()
rows, tokens = [logits], []
for _ in range(48):
    tokens.append(int(logits.argmax()))
    logits = session.step(tokens[-1]).float().cpu().clone()
    rows.append(logits)
session.close()
rows_t = torch.stack(rows)
report: dict = {"aligned": rows_t[:-1].argmax(-1).tolist() == tokens, "tokens": tokens}
torch.save({"tokens": tokens, "rows": rows_t}, out)
if len(sys.argv) > 3:
    earlier = torch.load(sys.argv[3])
    pairs = list(zip(earlier["tokens"], tokens, strict=True))
    first = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
    report["first_differing_step"] = first
    if first is not None:
        cands = (earlier["tokens"][first], tokens[first])
        report["candidates_earlier"] = [float(earlier["rows"][first][t]) for t in cands]
        report["candidates_this"] = [float(rows_t[first][t]) for t in cands]
        before = (earlier["rows"][: first + 1] - rows_t[: first + 1]).abs().max()
        report["max_abs_logit_diff_through_first"] = float(before)
    else:
        report["max_abs_logit_diff"] = float((earlier["rows"] - rows_t).abs().max())
print(json.dumps(report))
