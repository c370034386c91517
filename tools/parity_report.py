"""Print Kestrel-vs-transformers logit differences on tiny random Llama checkpoints.

    python tools/parity_report.py [--device cuda] [--json out.json]

The same comparisons as tests/engine/test_llama_parity.py, with the numbers shown rather than
asserted: max |ours - ref| / max |ref| per (shape, RoPE scaling, dtype), and whether 64
greedy tokens are identical. Use it to put measured numbers in a note.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import loader
from tests.helpers.model_factory import make_tiny_llama
from tests.helpers.parity import ROPE_VARIANTS, SHAPES, prompt_ids, rel_err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for shape, shape_cfg in SHAPES.items():
        for rope, rope_cfg in ROPE_VARIANTS.items():
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                if dtype == torch.float16 and args.device == "cpu":
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    hf = make_tiny_llama(Path(tmp), **shape_cfg, **rope_cfg)
                    ids = prompt_ids(150)
                    hf = hf.to(dtype).to(args.device)
                    with torch.no_grad():
                        ref = hf(torch.tensor([ids], device=args.device)).logits[0].float().cpu()
                    m = loader.load(
                        tmp, "kestrel", device=args.device, dtype=str(dtype).split(".")[1]
                    )
                    err = rel_err(m.logits(ids), ref)
                    greedy = None
                    if dtype == torch.float32:
                        prompt = prompt_ids(20, seed=7)
                        ref_ids = hf.generate(
                            torch.tensor([prompt], device=args.device),
                            attention_mask=torch.ones(1, 20, dtype=torch.long, device=args.device),
                            do_sample=False,
                            max_new_tokens=64,
                            min_new_tokens=64,
                            pad_token_id=0,
                        )[0, 20:].tolist()
                        settings = {"max_new_tokens": 64, "temperature": 0, "ban_eos_token": True}
                        ours = [t for c in m.stream(prompt, settings) for t in c.token_ids]
                        greedy = ours == ref_ids
                    m.unload()
                rows.append(
                    {
                        "shape": shape,
                        "rope": rope,
                        "dtype": str(dtype).split(".")[1],
                        "rel_err": err,
                        "greedy64_identical": greedy,
                    }
                )
                print(
                    f"{shape:11s} {rope:8s} {rows[-1]['dtype']:9s} rel_err {err:.2e}"
                    + ("" if greedy is None else f"  greedy64 identical: {greedy}")
                )
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {device_name}, torch {torch.__version__}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
