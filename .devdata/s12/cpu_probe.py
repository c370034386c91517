"""CPU probe for issue 29 (s12): SmolLM2-135M measured four ways (error reference
layer/module x in-sample/held-out 0.5) on the shared wiki text (first 60% of exllamav2's
wiki.utf8), the CPU default 8 x 512 measuring rows and the CPU's coarse scale search.
Prints seconds per layer per variant (the order rotates per layer, so warm-up and load
spread evenly), writes the four measurements, then the bits the allocation gives each
layer's attention at 4.0 and 3.0 bpw under each.

    .venv/bin/python .devdata/s12/cpu_probe.py MODEL_DIR WIKI_UTF8 OUT_DIR [LAYERS]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.quantizer import calibration as cal  # noqa: E402
from engine.quantizer.measure import measure_layer, role_of  # noqa: E402
from engine.quantizer.model import CalibrationRunner, LayerwiseModel  # noqa: E402
from engine.quantizer.strategy import (  # noqa: E402
    MEASUREMENT_FORMAT,
    candidate_bits,
    choose_strategy,
    layer_shapes,
    model_signature,
)
from engine.tokenizer import Tokenizer  # noqa: E402

model, wiki, out_dir = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
out_dir.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(2)
text = wiki.read_text(encoding="utf-8")
shared = out_dir / "shared-calibration.txt"  # the first 60%, as compare_converters
shared.write_text(text[: int(len(text) * 0.6)], encoding="utf-8")
tok = Tokenizer.from_dir(model)
ids = cal.calibration_rows(tok, [cal.read_calibration_text(shared)], 8, 512)
lm = LayerwiseModel(model, device=torch.device("cpu"), dtype=torch.float32)
layers = int(sys.argv[4]) if len(sys.argv) > 4 else lm.num_layers
runner = CalibrationRunner(lm, length=512, chunk_rows=4)
VARIANTS = [("layer", 0.0), ("module", 0.0), ("layer", 0.5), ("module", 0.5)]
states = lm.embed(ids).cpu()
records = {v: [] for v in VARIANTS}
seconds = {v: [] for v in VARIANTS}
for i in range(layers):
    lm.load_layer(i)
    nxt = None
    order = VARIANTS[i % 4 :] + VARIANTS[: i % 4]
    for ref, held in order:
        t0 = time.perf_counter()
        out, rec = measure_layer(
            runner, i, states, scale_search="coarse", error_reference=ref, heldout=held
        )
        seconds[ref, held].append(time.perf_counter() - t0)
        records[ref, held].append(rec)
        if nxt is None:
            nxt = out
        else:
            assert torch.allclose(nxt, out, rtol=1e-4, atol=1e-3), "layer outputs differ"
    line = "  ".join(
        f"{r}/{h}: {seconds[r, h][-1]:4.1f} s attn worst {max(e['err'] for e in records[r, h][-1]['attn']):.4f}"
        for r, h in VARIANTS
    )
    print(f"layer {i:2d}  {line}", flush=True)
    lm.unload_layer(i)
    states = nxt

summary = {}
for (ref, held), layer_records in records.items():
    name = f"{ref}-held{held}"
    m = {
        "format": MEASUREMENT_FORMAT,
        "model": model_signature(lm),
        "calibration": {"rows": 8, "length": 512},
        "scoring": {"error_reference": ref, "heldout": held},
        "layers": layer_records,
    }
    if layers == lm.num_layers:
        (out_dir / f"meas-{name}.json").write_text(json.dumps(m))
    s = seconds[ref, held]
    summary[name] = {
        "seconds_total": round(sum(s), 1),
        "seconds_median_layer": round(statistics.median(s), 2),
    }
    if layers == lm.num_layers:
        for bits in (4.0, 3.0):
            strategy, _, _ = choose_strategy(lm, m, bits)
            attn = []
            for li, layer in enumerate(strategy):
                linears = layer_shapes(lm, li)["attn"]
                profiles = {role_of(n): p for n, p in layer["attn"].items()}
                attn.append(
                    round(
                        candidate_bits(linears, profiles)
                        / sum(k * n for k, n, _ in linears.values()),
                        2,
                    )
                )
            summary[name][f"attn_bpw_{bits}"] = attn
    print(name, json.dumps(summary[name]), flush=True)
(out_dir / "probe-summary.json").write_text(json.dumps(summary, indent=1))
