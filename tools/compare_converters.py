"""Quantization quality: Kestrel's converter against round-to-nearest and exllamav2's.

    python tools/compare_converters.py --model models/SmolLM2-135M-Instruct-fp16 \
        --text wiki.utf8 --work /tmp/cmp --kestrel-bits 2.5 3 4 5 6 8 --rtn-bits 2.5 3 4 \
        --exllamav2-bits 3 4 --json results.json

One protocol for every model (the issue's): the first `--cal-fraction` of `--text` is the
calibration set (a one-row parquet, so both converters cut the same consecutive rows of
`--length` tokens), and perplexity is scored on the text from `--start-fraction` on, in
`--windows` windows of `--window` tokens with no BOS, by tools/perplexity.py through the
kestrel loader (so an exllamav2-written model is measured by the same code as ours).

Each converter measures once (`-om`) and reuses the measurement for every width. RTN uses
Kestrel's measurement and allocation, with round-to-nearest codes (convert.py --rtn), so
the GPTQ-versus-RTN gap is the error feedback alone. Finished outputs are kept in --work
and skipped on a rerun, so a long table can be made over several runs. exllamav2 needs a
CUDA GPU and the exllamav2 package (with the causal fix of the format reference applied).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], log: Path) -> None:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-2500:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (rc {proc.returncode}):\n{tail}")
    print(f"  {log.stem}: {time.perf_counter() - started:.0f} s", flush=True)


def _calibration_files(text: str, fraction: float, work: Path, parquet: bool) -> tuple[Path, Path]:
    """The calibration text as .txt (Kestrel) and, for exllamav2, as a one-row .parquet."""
    head = text[: int(len(text) * fraction)]
    txt, pq = work / "calibration.txt", work / "calibration.parquet"
    txt.write_text(head, encoding="utf-8")
    if parquet and not pq.is_file():
        import pandas

        pandas.DataFrame({"text": [head]}).to_parquet(pq)
    return txt, pq


def _kestrel(src: Path, out: Path, bits: float, meas: Path, cal: Path, a: argparse.Namespace,
             *, rtn: bool = False) -> Path:  # fmt: skip
    if (out / "config.json").is_file():
        return out
    cmd = [sys.executable, "convert.py", "-i", str(src), "-o", str(out), "-b", str(bits),
           "-hb", str(a.head_bits), "-c", str(cal), "-r", str(a.rows), "-l", str(a.length),
           "-mr", str(a.measure_rows), "-ml", str(a.measure_length), "-q"]  # fmt: skip
    if not meas.is_file():
        _run([*cmd[:6], "-om", str(meas), *cmd[6:]], out.parent / "kestrel-measure.log")
    _run([*cmd, "-m", str(meas), *(["--rtn"] if rtn else [])], out.parent / f"{out.name}.log")
    return out


def _exllamav2(src: Path, out: Path, bits: float, meas: Path, cal: Path,
               a: argparse.Namespace) -> Path:  # fmt: skip
    if (out / "config.json").is_file():
        return out
    base = [sys.executable, "-m", "exllamav2.conversion.convert_exl2", "-i", str(src),
            "-c", str(cal), "-hb", str(a.head_bits), "-r", str(a.rows), "-l", str(a.length),
            "-mr", str(a.measure_rows), "-ml", str(a.measure_length)]  # fmt: skip
    work = out.parent / f"{out.name}-job"
    if not meas.is_file():
        mwork = out.parent / "exllamav2-measure-job"
        _run([*base, "-o", str(mwork), "-om", str(meas), "-nr"], out.parent / "e-measure.log")
    _run(
        [*base, "-o", str(work), "-cf", str(out), "-b", str(bits), "-m", str(meas), "-nr"],
        out.parent / f"{out.name}.log",
    )
    return out


def _perplexity(model_dir: Path, text: str, a: argparse.Namespace) -> float:
    import loader
    from tools.perplexity import perplexity

    model = loader.load(model_dir, "kestrel", device=a.device, dtype="float16")
    try:
        return perplexity(
            model,
            text,
            window=a.window,
            windows=a.windows,
            start_fraction=a.start_fraction,
            add_bos=False,
        )
    finally:
        model.unload()


def _bpw(model_dir: Path) -> float | None:
    config = json.loads((model_dir / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("bits")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="FP16/BF16 model directory")
    p.add_argument("--text", required=True, help="UTF-8 text: calibration head, eval tail")
    p.add_argument("--work", required=True)
    p.add_argument("--kestrel-bits", type=float, nargs="*", default=[3.0, 4.0])
    p.add_argument("--rtn-bits", type=float, nargs="*", default=[])
    p.add_argument("--exllamav2-bits", type=float, nargs="*", default=[])
    p.add_argument("--head-bits", type=int, default=6)
    p.add_argument("--cal-fraction", type=float, default=0.6)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--measure-rows", type=int, default=16)
    p.add_argument("--measure-length", type=int, default=1024)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--start-fraction", type=float, default=0.8)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="write (and merge into) this JSON file")
    a = p.parse_args()

    src, work = Path(a.model), Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    text = Path(a.text).read_text(encoding="utf-8")
    cal, cal_parquet = _calibration_files(text, a.cal_fraction, work, bool(a.exllamav2_bits))
    results: dict = {}
    if a.json and Path(a.json).is_file():
        results = json.loads(Path(a.json).read_text())
    rows = results.setdefault("rows", {})

    def record(label: str, model_dir: Path) -> None:
        if label in rows:
            return
        started = time.perf_counter()
        ppl = _perplexity(model_dir, text, a)
        rows[label] = {"ppl": ppl, "bpw": _bpw(model_dir), "dir": model_dir.name}
        print(f"{label:24s} ppl {ppl:8.4f}  ({time.perf_counter() - started:.0f} s)", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))

    import torch

    results["setup"] = {
        "model": src.name, "text": Path(a.text).name, "cal_fraction": a.cal_fraction,
        "rows": a.rows, "length": a.length, "measure_rows": a.measure_rows,
        "measure_length": a.measure_length, "window": a.window, "windows": a.windows,
        "start_fraction": a.start_fraction, "bos": False, "head_bits": a.head_bits,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }  # fmt: skip
    record("fp16", src)
    kmeas, emeas = work / "kestrel-measurement.json", work / "exllamav2-measurement.json"
    for bits in a.kestrel_bits:
        record(f"kestrel {bits:g}", _kestrel(src, work / f"kestrel-{bits:g}", bits, kmeas, cal, a))
    for bits in a.rtn_bits:
        out = _kestrel(src, work / f"rtn-{bits:g}", bits, kmeas, cal, a, rtn=True)
        record(f"rtn {bits:g}", out)
    for bits in a.exllamav2_bits:
        out = _exllamav2(src, work / f"exllamav2-{bits:g}", bits, emeas, cal_parquet, a)
        record(f"exllamav2 {bits:g}", out)
    for label, row in rows.items():
        print(f"{label:24s} {row['bpw'] or '':>6} ppl {row['ppl']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
