"""Issue 28, session 22: the decode GEMV's cache warming before the PDL wait (GemvConfig
warm_metadata / warm_words) A/B on an 8B random-weight model, GPTQ and EXL2, batch 1, P512.

For each format and variant (base, meta, words, both, base again, in that order): load the
engine with the variant as _GEMV_CONFIG (the decode graphs are captured at load), then
  - greedy 48 tokens + logits after a fixed prompt (must equal the base variant's bit for bit);
  - the scheduler step (runner.forward + argmax + sync), 256 steps after a P512 prefill;
  - the decode graph replayed back to back, 300 replays, best of 5.
Writes $OUT/warm_ab.json; prints a table.
    python .devdata/s22/warm_ab.py OUT_JSON [formats...]
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, "tests")
import torch  # noqa: E402

from engine.cache import Sequence  # noqa: E402
from engine.engine import Engine, EngineOptions  # noqa: E402
from helpers.decoding import greedy_with_logits  # noqa: E402
from kernels.quant_matmul import gemv  # noqa: E402
from tools.bench import build_model  # noqa: E402

VARIANTS = {
    "base": (False, False),
    "meta": (True, False),
    "words": (False, True),
    "both": (True, True),
    "base2": (False, False),
}


def measure(path: Path, prompt_len: int = 512) -> dict:
    engine = Engine.load(
        path, EngineOptions(device="cuda", dtype="float16", max_seq_len=prompt_len + 512)
    )
    try:
        vocab = engine.config.vocab_size
        g = torch.Generator().manual_seed(7)
        prompt = torch.randint(2, vocab, (64,), generator=g).tolist()
        tokens, rows = greedy_with_logits(engine, prompt, 48)
        seq = Sequence()
        long_prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        tok = [int(engine.runner.prefill(seq, long_prompt)[-1].argmax())]
        for _ in range(8):
            tok = engine.runner.forward([seq], [tok]).argmax(-1).tolist()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(256):
            tok = engine.runner.forward([seq], [tok]).argmax(-1).tolist()
        step_ms = (time.perf_counter() - t) / 256 * 1e3
        graph = engine.graphs._graphs[(engine.graphs.bucket(1), 1)].graph
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(300):
                graph.replay()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t) / 300 * 1e3)
        return {"tokens": tokens, "rows": rows, "step_ms": step_ms, "replay_ms": best}
    finally:
        engine.unload()


def main() -> int:
    out = Path(sys.argv[1])
    formats = sys.argv[2:] or ["gptq", "exl2"]
    base_config = gemv._GEMV_CONFIG
    result: dict = {"gpu": torch.cuda.get_device_name(), "base_config": str(base_config)}
    for fmt in formats:
        path = build_model(Path("/tmp/kestrel-bench") / f"llama3-8b-{fmt}", "llama3-8b", fmt)
        ref = None
        for name, (meta, words) in VARIANTS.items():
            gemv._GEMV_CONFIG = dataclasses.replace(
                base_config, warm_metadata=meta, warm_words=words
            )
            try:
                m = measure(path)
            finally:
                gemv._GEMV_CONFIG = base_config
            if ref is None:
                ref = m
            same = m["tokens"] == ref["tokens"] and torch.equal(m["rows"], ref["rows"])
            row = {
                "step_ms": m["step_ms"],
                "replay_ms": m["replay_ms"],
                "tok_s_replay": 1e3 / m["replay_ms"],
                "same_bits_as_base": same,
            }
            result[f"{fmt}/{name}"] = row
            print(
                f"{fmt:5s} {name:6s} step {m['step_ms']:.3f} ms  replay {m['replay_ms']:.3f} ms "
                f"({1e3 / m['replay_ms']:.1f} tok/s)  same bits {same}",
                flush=True,
            )
            out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
