"""Issue 29, session 23 (CPU): calibration text the model writes itself. GPTQ's Hessians
follow its calibration text (session 22's transplant), and English-only text leaves the
channels other languages and code excite nearly unmeasured. Text sampled from the model
(temperature 1 from a few different openings) covers what the model itself puts weight on,
without choosing domains by hand.
    python .devdata/s23/selfgen.py MODEL_DIR OUT_TXT [ROWS] [TOKENS] [SEED]
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, out = sys.argv[1], sys.argv[2]
rows = int(sys.argv[3]) if len(sys.argv) > 3 else 16
tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 512
torch.manual_seed(int(sys.argv[5]) if len(sys.argv) > 5 else 0)
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
# Openings: BOS alone, and BOS + one token drawn uniformly from the vocabulary (any script).
bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
texts = []
batch = 4
for start in range(0, rows, batch):
    n = min(batch, rows - start)
    first = torch.randint(0, len(tok), (n, 1))
    ids = torch.cat([torch.full((n, 1), bos), first], dim=1)
    with torch.no_grad():
        outs = model.generate(
            ids, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=tokens,
            min_new_tokens=tokens, pad_token_id=bos,
        )
    for o in outs:
        texts.append(tok.decode(o[1:], skip_special_tokens=True))
    print(f"{start + n}/{rows} rows", file=sys.stderr, flush=True)
with open(out, "w") as f:
    f.write("\n\n".join(texts))
