"""Issue 29 device runner, session 12: do the measurement changes close the 4.0-bpw
multilingual gap on the shared wiki calibration (Kestrel 45.98, exllamav2 43.87)?

    python .devdata/s12/q29_run.py --model /tmp/q29s12/smol-fp16 --work /tmp/q29s12 \
        --out "$OUT" --wiki /tmp/q29s12/wiki.utf8 --deadline-s 540 [--only NAME ...]

Measurements (each made once, Kestrel's GPU default 12 x 2048 measuring rows, on the
shared text: the first 60% of exllamav2's wiki.utf8, as tools/compare_converters.py):
  shared          today's: --error_reference layer, in-sample (session 11's baseline)
  shared-module   --error_reference module (hypothesis 1 of notes/issue-29-s11.md)
  shared-held     --heldout_scoring 0.5 (Hessians from rows 0-5, scores on rows 6-11)
  shared-modheld  both
  mix-module      --error_reference module on the default mix (must not lose there)
Each variant converts reusing one of them (only the allocation and/or the GPTQ pass
change) and is scored on the 5 held-out domains (20 x 1024-token windows, no BOS),
exactly as tools/compare_converters.py does. Per variant the log also shows the bits the
allocation gave each layer's attention and MLP (layer 0's attention is the suspect).

Resumable: finished steps are recorded in WORK/q29-results.json and skipped; a step is not
started when its estimated time (its measurement's included when that is not made yet)
would pass --deadline-s (seconds since this process started), so rerun the same command
until it prints "Q29 ALL DONE". Results go to OUT/q29-results.json after every step.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.quantizer import ConvertOptions, convert  # noqa: E402
from tools.compare_converters import _perplexities, _shared_files  # noqa: E402
from tools.perplexity import domain_texts  # noqa: E402

# Reference numbers (bench/results/2026-11-27-h100-quant-domains.json, one H100).
REFERENCE = {
    "fp16": {"wiki": 19.27, "web": 33.10, "code": 5.350, "multilingual": 30.26, "chat": 17.52},
    "kestrel shared 4 (11-27)": {
        "wiki": 22.37, "web": 39.11, "code": 6.883, "multilingual": 45.98, "chat": 20.85},
    "exllamav2 shared 4 (11-27)": {
        "wiki": 23.30, "web": 42.70, "code": 7.020, "multilingual": 43.87, "chat": 22.65},
    "kestrel shared 3 (11-27)": {
        "wiki": 36.57, "web": 69.01, "code": 17.14, "multilingual": 122.60, "chat": 40.03},
    "exllamav2 shared 3 (11-27)": {
        "wiki": 40.56, "web": 80.91, "code": 18.47, "multilingual": 134.72, "chat": 50.44},
    "kestrel default 4 (11-27)": {
        "wiki": 22.69, "web": 38.68, "code": 6.165, "multilingual": 40.14, "chat": 20.62},
    "exllamav2 default 4 (11-27)": {
        "wiki": 24.53, "web": 42.69, "code": 6.717, "multilingual": 41.53, "chat": 22.36},
}  # fmt: skip

SHARED, MIX = "shared", "mix"  # calibration: the shared wiki text, or Kestrel's default mix
# name: (calibration, measuring options, estimated seconds on an H100)
MEASUREMENTS: dict[str, tuple[str, dict[str, Any], int]] = {
    "shared": (SHARED, {}, 200),
    "shared-module": (SHARED, {"error_reference": "module"}, 200),
    "shared-held": (SHARED, {"heldout": 0.5}, 190),
    "shared-modheld": (SHARED, {"error_reference": "module", "heldout": 0.5}, 190),
    "mix-module": (MIX, {"error_reference": "module"}, 200),
}
# (name, measurement, convert options, measurement transform, bits, est. seconds)
# Ordered by what each tells, the new measurements first; --only picks a subset.
VARIANTS: list[tuple[str, str, dict[str, Any], str | None, float, int]] = [
    ("base", "shared", {}, None, 4.0, 90),  # control: reproduces 45.98
    ("module", "shared-module", {}, None, 4.0, 90),  # hypothesis 1, the product option
    ("held", "shared-held", {}, None, 4.0, 90),  # in-sample optimism
    ("l0attn", "shared", {}, "l0attn", 4.0, 90),  # s11's hand-made version of "module"
    ("modheld", "shared-modheld", {}, None, 4.0, 90),
    ("module3", "shared-module", {}, None, 3.0, 75),  # the other width the issue asks for
    ("held3", "shared-held", {}, None, 3.0, 75),
    ("mix-module", "mix-module", {}, None, 4.0, 90),  # against "kestrel default 4"
    # Session 11's other probes (notes/issue-29-s11.md), on today's measurement.
    ("norm3", "shared", {"error_norm": 3.0}, None, 4.0, 90),
    ("rows100", "shared", {"rows": 100}, None, 4.0, 120),
    ("damp012", "shared", {"damp": 0.12}, None, 4.0, 90),
]


def l0attn(measurement: dict) -> dict:
    """Layer 0's attention errors scaled so that its worst candidate's error equals the
    median of the other layers' worst attention candidates (session 11's diagnostic)."""
    m = copy.deepcopy(measurement)
    worst = [max(e["err"] for e in layer["attn"]) for layer in m["layers"]]
    factor = statistics.median(worst[1:]) / worst[0]
    for e in m["layers"][0]["attn"]:
        e["err"] *= factor
    m["q29_transform"] = {"l0attn_factor": factor}
    return m


TRANSFORMS = {"l0attn": l0attn}


def module_bits(src: Path, measurement: dict, bits: float, norm: float) -> dict[str, list]:
    """Bits per weight the allocation gives each layer's attention and MLP (the strategy
    the conversion records, recomputed from the same measurement)."""
    import torch

    from engine.quantizer.measure import role_of
    from engine.quantizer.model import LayerwiseModel
    from engine.quantizer.strategy import candidate_bits, choose_strategy, layer_shapes

    lm = LayerwiseModel(src, device=torch.device("cpu"), dtype=torch.float32)
    strategy, _, _ = choose_strategy(lm, measurement, bits, error_norm=norm)
    out: dict[str, list] = {"attn": [], "mlp": []}
    for i, layer in enumerate(strategy):
        for kind, linears in layer_shapes(lm, i).items():
            profiles = {role_of(n): p for n, p in layer[kind].items()}
            numel = sum(k * n for k, n, _ in linears.values())
            out[kind].append(round(candidate_bits(linears, profiles) / numel, 3))
    return out


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
    measured = results.setdefault("measurements", {})
    results["reference"] = REFERENCE

    import torch

    results["setup"] = {
        "model": src.name, "shared calibration": "first 60% of exllamav2 wiki.utf8",
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
    calibration = {SHARED: cal_txt, MIX: None}

    def score(label: str, model_dir: Path, extra: dict) -> None:
        t0 = time.perf_counter()
        ppl = _perplexities(model_dir, texts, ppl_args)
        rows[label] = {"ppl": ppl, **extra, "ppl_seconds": round(time.perf_counter() - t0, 1)}
        shown = "  ".join(f"{d} {v:.3f}" for d, v in ppl.items())
        print(f"{label:10s} {shown}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        save()

    if "fp16" not in rows:
        score("fp16", src, {})

    def measurement_path(name: str) -> Path:
        return work / f"meas-{name}.json"

    def measure(name: str) -> None:
        cal_name, opts, _ = MEASUREMENTS[name]
        t0 = time.perf_counter()
        convert(src, work / f"meas-job-{name}", ConvertOptions(
            bits=4.0, calibration=calibration[cal_name], measurement_out=measurement_path(name),
            measure_only=True, progress=False, resume=True, **opts))  # fmt: skip
        seconds = round(time.perf_counter() - t0, 1)
        record = json.loads(measurement_path(name).read_text())
        l0 = max(e["err"] for e in record["layers"][0]["attn"])
        others = statistics.median(max(e["err"] for e in la["attn"]) for la in record["layers"][1:])
        measured[name] = {"seconds": seconds, "options": opts, "calibration": cal_name,
                          "scoring": record.get("scoring"), "l0_attn_worst": l0,
                          "median_other_attn_worst": others}  # fmt: skip
        print(f"measurement {name}: {seconds:.0f} s; worst attention error layer 0 {l0:.4f}, "
              f"median of the other layers {others:.4f}", flush=True)  # fmt: skip
        save()

    for name, meas_name, opts, transform, bits, estimate in VARIANTS:
        if a.only and name not in a.only:
            continue
        if name in rows:
            continue
        need = estimate + (0 if measurement_path(meas_name).is_file() else
                           MEASUREMENTS[meas_name][2])  # fmt: skip
        if left() < need:
            print(f"Q29 STOPPED before {name}: {left():.0f} s left, it needs ~{need} s; rerun")
            save()
            return 0
        try:
            if not measurement_path(meas_name).is_file():
                measure(meas_name)
            measurement = json.loads(measurement_path(meas_name).read_text())
            meas = measurement_path(meas_name)
            if transform:
                measurement = TRANSFORMS[transform](measurement)
                meas = work / f"meas-{meas_name}-{transform}.json"
                meas.write_text(json.dumps(measurement))
            dst = work / f"kestrel-{name}"
            t0 = time.perf_counter()
            result = convert(src, dst, ConvertOptions(
                bits=bits, calibration=calibration[MEASUREMENTS[meas_name][0]],
                measurement_in=meas, progress=False, resume=True, **opts))  # fmt: skip
            seconds = round(time.perf_counter() - t0, 1)
            alloc = module_bits(src, measurement, bits, float(opts.get("error_norm", 2.0)))
        except Exception as e:  # one failed variant must not cost the others
            rows[name] = {"error": f"{type(e).__name__}: {e}", "options": opts}
            traceback.print_exc()
            save()
            continue
        print(f"{name}: converted in {seconds:.0f} s, {result.bpw:.4f} bpw; attention bpw per "
              f"layer {alloc['attn']}; MLP {alloc['mlp']}", flush=True)  # fmt: skip
        qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
        extra = {"measurement": meas_name, "options": opts, "transform": transform,
                 "bits": bits, "bpw": result.bpw, "convert_seconds": seconds,
                 "calibration": qcfg.get("calibration"), "module_bpw": alloc}  # fmt: skip
        score(name, dst, extra)

    print("\nperplexity on the held-out domains (lower is better); shared = wiki calibration")
    domains = list(texts)
    print(f"{'variant':34s} {'bits':>5s} " + " ".join(f"{d:>12s}" for d in domains))
    for label, row in [*REFERENCE.items(), *rows.items()]:
        if "error" in row:
            print(f"{label:34s} ERROR {row['error']}")
            continue
        ppl = row.get("ppl", row)
        bits = f"{row['bits']:.1f}" if "bits" in row else ""
        print(f"{label:34s} {bits:>5s} " + " ".join(f"{ppl[d]:12.3f}" for d in domains))
    for name, m in measured.items():
        print(
            f"measurement {name:16s} {m['seconds']:6.0f} s  layer-0 attention worst "
            f"{m['l0_attn_worst']:.4f} (others' median {m['median_other_attn_worst']:.4f})"
        )
    print("Q29 ALL DONE")
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
