"""Issue 28, session 24: decode attention alone, 8B shape (32 query heads, 8 kv heads, 128
dims, fp16 cache), one sequence: µs per layer over 32 layers' caches in turn (a CUDA graph
of 32 calls, so the caches come from HBM as in a decode step), at the plan the engine
picks and at forced keys per split.
    python .devdata/s24/attn_probe.py OUT_JSON [CONTEXTS [SPLIT_TOKENS [nowide]]]
CONTEXTS, SPLIT_TOKENS: comma-separated (plan: the engine's own plan).
"""

from __future__ import annotations

import json
import sys

import torch

from kernels.attention import decode
from tools.profile_decode import _graph_time

LAYERS, HQ, HK, D, PAGE = 32, 32, 8, 128, 256


def probe(context: int, split_tokens: int | None, headroom: int = 256) -> float:
    pages = -(-(context + headroom) // PAGE)
    dev = "cuda"
    caches = [
        (torch.randn(pages, PAGE, HK, D, device=dev, dtype=torch.float16),
         torch.randn(pages, PAGE, HK, D, device=dev, dtype=torch.float16))
        for _ in range(LAYERS)
    ]  # fmt: skip
    q = torch.randn(1, HQ, D, device=dev, dtype=torch.float16)
    cu = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    lens = torch.tensor([context], device=dev, dtype=torch.int32)
    table = torch.arange(pages, device=dev, dtype=torch.int32)[None]

    def round_of_calls() -> None:
        for k, v in caches:
            decode.decode_attention(
                q, k, v, cu, lens, table, scale=D**-0.5, sliding_window=None, softcap=None,
                max_context_len=context + headroom, split_tokens=split_tokens,
            )  # fmt: skip

    return _graph_time(round_of_calls, calls=4, reps=5) / LAYERS * 1e6


def main() -> int:
    out: dict = {"gpu": torch.cuda.get_device_name(), "us_per_layer": {}}
    contexts = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else [512, 2048, 8192]
    splits = [None, 64, 128, 256, 512, 1024, 1 << 20]
    if len(sys.argv) > 3:
        splits = [None if s == "plan" else int(s) for s in sys.argv[3].split(",")]
    if len(sys.argv) > 4 and sys.argv[4] == "nowide":
        # The plan without wide_split_config's 128-key blocks on 8 warps.
        decode.wide_split_config = lambda *args, **kwargs: None
        out["nowide"] = True
    for context in contexts:
        for st in splits:
            if st is not None and st > context + 256 and st != 1 << 20:
                continue
            us = probe(context, st)
            key = f"P{context} split_tokens={'plan' if st is None else st}"
            out["us_per_layer"][key] = us
            kv_bytes = 2 * context * HK * D * 2
            print(f"{key:32s} {us:7.2f} us  {kv_bytes / us / 1e3:7.1f} GB/s", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
