"""Issue 29 device runner: why Kestrel loses 4.0-bpw multilingual with the shared wiki text.

    python .devdata/s11/q29_run.py --model /tmp/q29/smol-fp16 --work /tmp/q29 \
        --out "$OUT" --deadline-s 540

One measurement (the shared text: first 60% of exllamav2's wiki.utf8, Kestrel's default
12x2048 measuring rows), then each variant quantizes at 4.0 bpw reusing it (only the
allocation and/or the GPTQ pass change), and every output is scored on the 5 held-out
domains (20 x 1024-token windows, no BOS), exactly as tools/compare_converters.py does.

Resumable: finished steps are recorded in WORK/q29-results.json and skipped; a step is not
started when its estimated time would pass --deadline-s (seconds since this process
started), so rerun the same command until it prints "Q29 ALL DONE". Results are copied to
OUT/q29-results.json after every step.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.quantizer import ConvertOptions, convert  # noqa: E402
from tools.compare_converters import _perplexities, _shared_files  # noqa: E402
from tools.perplexity import domain_texts  # noqa: E402

BITS = 4.0
# Reference numbers (bench/results/2026-11-27-h100-quant-domains.json, one H100).
REFERENCE = {
    "fp16": {"wiki": 19.27, "web": 33.10, "code": 5.350, "multilingual": 30.26, "chat": 17.52},
    "kestrel shared 4 (2026-11-27)": {
        "wiki": 22.37, "web": 39.11, "code": 6.883, "multilingual": 45.98, "chat": 20.85},
    "exllamav2 shared 4 (2026-11-27)": {
        "wiki": 23.30, "web": 42.70, "code": 7.020, "multilingual": 43.87, "chat": 22.65},
}  # fmt: skip

# (name, convert options beyond the shared defaults, measurement transform, est. seconds)
# Ordered by how much each tells: the most likely cause first.
VARIANTS: list[tuple[str, dict, str | None, int]] = [
    ("base", {}, None, 90),
    ("l0attn", {}, "l0attn", 90),  # layer 0's attention scored like the other layers'
    ("rows100", {"rows": 100}, None, 120),  # exllamav2's 100 x 2048 GPTQ rows
    ("norm3", {"error_norm": 3.0}, None, 90),  # allocation objective sum err^3
    ("damp012", {"damp": 0.12}, None, 90),  # exllamav2's damping
    ("damp030", {"damp": 0.30}, None, 90),  # the direction of damping
    ("exl2like", {"rows": 100, "damp": 0.12, "error_norm": 3.0}, "l0attn", 120),
]


def l0attn(measurement: dict) -> dict:
    """Layer 0's attention errors scaled so that its cheapest candidate's error equals the
    median of the other layers' cheapest attention candidates. Kestrel scores a module
    against the layer's output stream; in SmolLM2's layer 0 the attention errors come out
    20-30x smaller than in any other layer, and the allocation gives it the cheapest rung
    at every target and norm. A diagnostic, not a product setting."""
    m = copy.deepcopy(measurement)
    worst = [max(e["err"] for e in layer["attn"]) for layer in m["layers"]]
    factor = statistics.median(worst[1:]) / worst[0]
    for e in m["layers"][0]["attn"]:
        e["err"] *= factor
    m["q29_transform"] = {"l0attn_factor": factor}
    return m


TRANSFORMS = {"l0attn": l0attn}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--wiki", required=True, help="exllamav2's full wiki.utf8")
    p.add_argument("--deadline-s", type=float, default=540)
    p.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    a = p.parse_args()
    started = time.perf_counter()
    src, work, out = Path(a.model), Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    results_path = work / "q29-results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    rows = results.setdefault("rows", {})
    results.setdefault("reference", REFERENCE)

    import torch

    results["setup"] = {
        "model": src.name, "bits": BITS, "calibration": "first 60% of exllamav2 wiki.utf8",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "windows": 20, "window": 1024, "bos": False,
    }  # fmt: skip

    def save() -> None:
        text = json.dumps(results, indent=1)
        results_path.write_text(text)
        (out / "q29-results.json").write_text(text)

    def left() -> float:
        return a.deadline_s - (time.perf_counter() - started)

    texts = domain_texts(None)
    ppl_args = argparse.Namespace(device=None, window=1024, windows=20)
    cal_txt, _ = _shared_files(Path(a.wiki), 0.6, work)

    def score(label: str, model_dir: Path, extra: dict) -> None:
        t0 = time.perf_counter()
        ppl = _perplexities(model_dir, texts, ppl_args)
        rows[label] = {"ppl": ppl, **extra, "ppl_seconds": round(time.perf_counter() - t0, 1)}
        shown = "  ".join(f"{d} {v:.3f}" for d, v in ppl.items())
        print(f"{label:10s} {shown}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        save()

    if "fp16" not in rows:
        score("fp16", src, {})

    meas_path = work / "meas-shared.json"
    if not meas_path.is_file():
        if left() < 260:
            print(f"Q29 STOPPED: {left():.0f} s left, the measurement needs ~200 s; rerun")
            save()
            return 0
        t0 = time.perf_counter()
        convert(src, work / "meas-job", ConvertOptions(
            bits=BITS, calibration=cal_txt, measurement_out=meas_path, measure_only=True,
            progress=False, resume=True))  # fmt: skip
        results["measure_seconds"] = round(time.perf_counter() - t0, 1)
        print(f"measurement: {results['measure_seconds']:.0f} s", flush=True)
        save()
    measurement = json.loads(meas_path.read_text())

    for name, opts, transform, estimate in VARIANTS:
        if a.only and name not in a.only:
            continue
        if name in rows:
            continue
        if left() < estimate:
            print(f"Q29 STOPPED before {name}: {left():.0f} s left, it needs ~{estimate} s; rerun")
            save()
            return 0
        meas = meas_path
        if transform:
            meas = work / f"meas-{transform}.json"
            meas.write_text(json.dumps(TRANSFORMS[transform](measurement)))
        dst = work / f"kestrel-{name}"
        t0 = time.perf_counter()
        try:
            result = convert(src, dst, ConvertOptions(
                bits=BITS, calibration=cal_txt, measurement_in=meas, progress=False,
                resume=True, **opts))  # fmt: skip
        except Exception as e:  # one failed variant must not cost the others
            rows[name] = {"error": f"{type(e).__name__}: {e}", "options": opts}
            traceback.print_exc()
            save()
            continue
        seconds = round(time.perf_counter() - t0, 1)
        print(f"{name}: converted in {seconds:.0f} s, {result.bpw:.4f} bpw", flush=True)
        qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
        extra = {"options": opts, "transform": transform, "bpw": result.bpw,
                 "convert_seconds": seconds, "calibration": qcfg.get("calibration")}  # fmt: skip
        score(name, dst, extra)

    print("\nperplexity, 4.0 bpw, shared wiki calibration (lower is better)")
    domains = list(texts)
    print(f"{'variant':34s} " + " ".join(f"{d:>12s}" for d in domains))
    for label, row in [*REFERENCE.items(), *rows.items()]:
        ppl = row.get("ppl", row) if isinstance(row, dict) else {}
        if "error" in row:
            print(f"{label:34s} ERROR {row['error']}")
            continue
        print(f"{label:34s} " + " ".join(f"{ppl[d]:12.3f}" for d in domains))
    print("Q29 ALL DONE")
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
