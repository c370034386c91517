"""Quantization quality: Kestrel's converter against round-to-nearest and exllamav2's, on
several held-out domains at once.

    python tools/compare_converters.py --model models/SmolLM2-135M-Instruct-fp16 \
        --work /tmp/cmp --kestrel-bits 2.5 3 4 5 6 --rtn-bits 2.5 3 4 5 6 \
        --exllamav2-bits 2.5 3 4 5 6 --exllamav2-runs 3 --calibrations default shared \
        --shared-text wiki.utf8 --json results.json

Calibration settings (--calibrations, one or both):
- `default`: each converter as a user runs it, with its own default calibration text and
  rows × length (Kestrel: the mix shipped in engine/quantizer/data; exllamav2: its standard
  calibration set);
- `shared`: both calibrate on one text, the first --cal-fraction of --shared-text (given
  to exllamav2 as a one-row parquet, to Kestrel as .txt, or as that parquet with
  --kestrel-shared-as parquet), each with its default rows ×
  length unless --rows/--length/--measure-rows/--measure-length say otherwise.

Evaluation: perplexity on the held-out domains of tools/heldout (--domains, default all:
wiki, web, code, multilingual, chat; none of that text is in either converter's default
calibration set, and the wiki text is the last 20% of the Wikipedia file whose head is the
shared text), --windows windows of 1024 tokens a domain from the start of each file, BOS in
front where the model's tokenizer adds one (Gemma) and none where it does not (SmolLM2),
through the kestrel loader (tools/perplexity.py), so exllamav2-written models are
measured by the same code as ours.

Each converter measures once per calibration (`-om`) and reuses the measurement for every
width. exllamav2's converter does not make the same file twice (its held-out perplexities
moved by up to 8% between runs of one command on one GPU), so --exllamav2-runs N converts
each of its rows N times from scratch (a measurement of its own each) and adds a row of
their per-domain medians, the figure to compare with; Kestrel's figures repeat run to run.
RTN uses Kestrel's measurement and allocation with round-to-nearest codes
(convert.py --rtn), so the GPTQ-versus-RTN gap is the error feedback alone. Finished
outputs are kept in --work and skipped on a rerun; --json is merged into, so a long table
can be made over several runs. exllamav2 needs a CUDA GPU and the exllamav2 package.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from tools.exllamav2_gemma3 import from_exllamav2, to_exllamav2  # noqa: E402
from tools.perplexity import (  # noqa: E402
    DOMAIN_WINDOWS,
    DOMAINS,
    bos_words,
    domain_table,
    domain_texts,
)

CALIBRATIONS = ("default", "shared")


def _run(cmd: list[str], log: Path) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-2500:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (rc {proc.returncode}):\n{tail}")
    seconds = time.perf_counter() - started
    print(f"  {log.stem}: {seconds:.0f} s", flush=True)
    return seconds


def _shared_files(text_path: Path, fraction: float, work: Path) -> tuple[Path, Path]:
    """The shared calibration text as .txt (Kestrel) and as a one-row .parquet (exllamav2)."""
    text = text_path.read_text(encoding="utf-8")
    head = text[: int(len(text) * fraction)]
    txt, pq = work / "shared-calibration.txt", work / "shared-calibration.parquet"
    txt.write_text(head, encoding="utf-8")
    if not pq.is_file():
        try:
            import pandas

            pandas.DataFrame({"text": [head]}).to_parquet(pq)
        except ImportError:
            pass  # only exllamav2 needs it, and then says so
    return txt, pq


def _kestrel_shared_file(shared_as: str, txt: Path | None, pq: Path | None) -> Path | None:
    """The shared calibration file Kestrel reads. With "parquet" both converters get the
    same bytes: Kestrel's .txt reader drops the `<doc …>` header lines of a Wikipedia dump,
    which exllamav2 reads as text (14% of its calibration tokens on wiki.utf8). The
    README's tables use "text", a user's path."""
    if shared_as != "parquet" or txt is None:
        return txt
    if pq is None or not pq.is_file():
        raise SystemExit("--kestrel-shared-as parquet needs pandas and pyarrow to write it")
    return pq


def _row_args(a: argparse.Namespace) -> list[str]:
    args = []
    for flag, value in (("-r", a.rows), ("-l", a.length), ("-mr", a.measure_rows),
                        ("-ml", a.measure_length)):  # fmt: skip
        if value is not None:
            args += [flag, str(value)]
    return args


def _kestrel(src: Path, out: Path, bits: float, meas: Path, cal: Path | None,
             a: argparse.Namespace, *, rtn: bool = False) -> float | None:  # fmt: skip
    """Seconds the conversion took (measurement included when it made one); None if done."""
    if (out / "config.json").is_file():
        return None
    cmd = [sys.executable, "convert.py", "-i", str(src), "-o", str(out), "-b", str(bits),
           "-hb", str(a.head_bits), *(["-c", str(cal)] if cal else []), *_row_args(a), "-q",
           *a.kestrel_args]  # fmt: skip
    seconds = 0.0
    if not meas.is_file():
        # Flags that shape the measurement (--token_power, ...) go to this call only: the
        # quantizing call reuses it with -m, which refuses them.
        measuring = [*cmd[:6], "-om", str(meas), *cmd[6:], *a.kestrel_measure_args]
        seconds += _run(measuring, out.parent / f"{meas.stem}.log")
    quantizing = [*cmd, "-m", str(meas), *(["--rtn"] if rtn else []), *a.kestrel_quantize_args]
    seconds += _run(quantizing, out.parent / f"{out.name}.log")
    return seconds


def _exllamav2(src: Path, out: Path, bits: float, meas: Path, cal: Path | None,
               a: argparse.Namespace) -> float | None:  # fmt: skip
    if (out / "config.json").is_file():
        return None
    # A text-only Gemma 3 goes in as the multimodal checkpoint exllamav2 0.3.2 knows.
    src = to_exllamav2(src, out.parent)
    base = [sys.executable, "-m", "exllamav2.conversion.convert_exl2", "-i", str(src),
            *(["-c", str(cal)] if cal else []), "-hb", str(a.head_bits), *_row_args(a)]  # fmt: skip
    work = out.parent / f"{out.name}-job"
    seconds = 0.0
    if not meas.is_file():
        mwork = out.parent / f"{meas.stem}-job"
        seconds += _run([*base, "-o", str(mwork), "-om", str(meas), "-nr"],
                        out.parent / f"{meas.stem}.log")  # fmt: skip
    seconds += _run(
        [*base, "-o", str(work), "-cf", str(out), "-b", str(bits), "-m", str(meas), "-nr"],
        out.parent / f"{out.name}.log",
    )
    from_exllamav2(out)  # back to the text-only names Kestrel reads (others: unchanged)
    return seconds


def _perplexities(model_dir: Path, texts: dict[str, str], a: argparse.Namespace):
    import loader
    from tools.perplexity import domain_perplexities

    # No decode CUDA graphs: scoring never decodes.
    model = loader.load(  # window + 1: room for a BOS in front (tools/perplexity.py)
        model_dir, "kestrel", device=a.device, max_seq_len=a.window + 1, cuda_graphs=False
    )
    try:
        return domain_perplexities(model, texts, window=a.window, windows=a.windows)
    finally:
        model.unload()


def _quantization_config(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("quantization_config") or {}


def _bpw(model_dir: Path) -> float | None:
    q = _quantization_config(model_dir)
    return q.get("achieved_bits") or q.get("bits")


# What a Kestrel output says of how it was made (convert.py --shrink auto's choice).
RECORDED_KEYS = ("hessian_shrink", "hessian_shrink_heldout_ppl")


def median_row(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per-domain medians of several runs' perplexities (every run must score the same
    domains): the middle run's figure, or the mean of the two middle ones."""
    if not runs:
        raise ValueError("no runs to take a median of")
    domains = list(runs[0])
    if any(set(r) != set(domains) for r in runs):
        raise ValueError(f"runs score different domains: {[sorted(r) for r in runs]}")
    return {d: statistics.median(r[d] for r in runs) for d in domains}


def _exllamav2_run_names(calib: str, bits: float, runs: int) -> list[tuple[str, str, str]]:
    """(row label, output folder, measurement file stem) of each exllamav2 run: the first
    run's are the one-run names, so a one-run table's row and folder are its first run."""
    label, name = f"exllamav2 {calib} {bits:g}", f"exllamav2-{calib}-{bits:g}"
    meas = f"exllamav2-{calib}-measurement"
    return [(label, name, meas)] + [(f"{label} run {r}", f"{name}-run{r}", f"{meas}-run{r}")
                                    for r in range(2, runs + 1)]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--model", required=True, help="FP16/BF16 model directory")
    p.add_argument("--work", required=True, help="outputs and logs (kept for reruns)")
    p.add_argument("--kestrel-bits", type=float, nargs="*", default=[3.0, 4.0])
    p.add_argument("--rtn-bits", type=float, nargs="*", default=[])
    p.add_argument("--exllamav2-bits", type=float, nargs="*", default=[])
    p.add_argument(
        "--exllamav2-runs",
        type=int,
        default=1,
        help="convert each exllamav2 row this many times (its converter is not deterministic) "
        "and add a row of their medians",
    )
    p.add_argument("--calibrations", nargs="+", choices=CALIBRATIONS, default=["default"])
    p.add_argument("--shared-text", help="UTF-8 text whose head is the shared calibration")
    p.add_argument("--cal-fraction", type=float, default=0.6)
    p.add_argument(
        "--kestrel-shared-as",
        choices=("text", "parquet"),
        default="text",
        help="the shared text reaches Kestrel as .txt (its text reader drops `<doc ...>` "
        "lines) or as exllamav2's parquet file (the same bytes, markup kept; needs pyarrow)",
    )
    p.add_argument("--kestrel-args", nargs="*", default=[], help="more convert.py flags")
    p.add_argument(
        "--kestrel-measure-args",
        nargs="*",
        default=[],
        help="convert.py flags for Kestrel's measurement only, written with '=' "
        "(--kestrel-measure-args=--token_power=2); its measurement file is reused from "
        "--work, so give each setting a work directory of its own",
    )
    p.add_argument(
        "--kestrel-quantize-args",
        nargs="*",
        default=[],
        help="convert.py flags for Kestrel's quantizing calls only (each width's, after the "
        "measurement), written with '=' (--kestrel-quantize-args=--damp=0.3)",
    )
    p.add_argument("--head-bits", type=int, default=6)
    p.add_argument("--rows", type=int, help="calibration rows (default: each converter's)")
    p.add_argument("--length", type=int, help="tokens per row (default: each converter's)")
    p.add_argument("--measure-rows", type=int)
    p.add_argument("--measure-length", type=int)
    p.add_argument("--domains", nargs="+", default=list(DOMAINS))
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--windows", type=int, default=DOMAIN_WINDOWS, help="windows a domain")
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="write (and merge into) this JSON file")
    a = p.parse_args(argv)
    if "shared" in a.calibrations and not a.shared_text:
        p.error("--calibrations shared needs --shared-text")
    if a.exllamav2_runs < 1:
        p.error(f"--exllamav2-runs must be 1 or more, got {a.exllamav2_runs}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    src, work = Path(a.model), Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    texts = domain_texts(a.domains)
    results: dict = {}
    if a.json and Path(a.json).is_file():
        results = json.loads(Path(a.json).read_text())
    rows = results.setdefault("rows", {})

    def record(
        label: str, model_dir: Path, convert: Callable[[], float | None] | None = None
    ) -> None:
        """Convert (`convert`: the seconds it took, None when its output was there) and
        score `label`'s row, unless the JSON holds it already (its folder may be gone)."""
        if label in rows:
            return
        seconds = convert() if convert is not None else None
        started = time.perf_counter()
        ppl = _perplexities(model_dir, texts, a)
        q = _quantization_config(model_dir) if (model_dir / "config.json").is_file() else {}
        rows[label] = {"ppl": ppl, "bpw": _bpw(model_dir), "dir": model_dir.name,
                       "convert_seconds": seconds, "scored": [a.window, a.windows],
                       **{k: q[k] for k in RECORDED_KEYS if k in q}}  # fmt: skip
        shown = "  ".join(f"{d} {v:.3f}" for d, v in ppl.items())
        print(f"{label:28s} {shown}  ({time.perf_counter() - started:.0f} s)", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))

    import torch

    results["setup"] = {
        "model": src.name, "calibrations": a.calibrations,
        "shared_text": Path(a.shared_text).name if a.shared_text else None,
        "cal_fraction": a.cal_fraction, "kestrel_shared_as": a.kestrel_shared_as,
        "rows": a.rows, "length": a.length,
        "measure_rows": a.measure_rows, "measure_length": a.measure_length,
        "kestrel_args": a.kestrel_args, "kestrel_measure_args": a.kestrel_measure_args,
        "kestrel_quantize_args": a.kestrel_quantize_args, "domains": a.domains, "window": a.window,
        "windows": a.windows, "bos": bos_words(None), "head_bits": a.head_bits,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }  # fmt: skip
    record("fp16", src)
    shared_txt, shared_pq = (
        _shared_files(Path(a.shared_text), a.cal_fraction, work) if a.shared_text else (None, None)
    )
    k_shared = _kestrel_shared_file(a.kestrel_shared_as, shared_txt, shared_pq)
    for calib in a.calibrations:
        k_cal = k_shared if calib == "shared" else None
        e_cal = shared_pq if calib == "shared" else None
        kmeas = work / f"kestrel-{calib}-measurement.json"
        for bits in a.kestrel_bits:
            out = work / f"kestrel-{calib}-{bits:g}"
            record(f"kestrel {calib} {bits:g}", out,
                   partial(_kestrel, src, out, bits, kmeas, k_cal, a))  # fmt: skip
        for bits in a.rtn_bits:
            out = work / f"rtn-{calib}-{bits:g}"
            record(f"rtn {calib} {bits:g}", out,
                   partial(_kestrel, src, out, bits, kmeas, k_cal, a, rtn=True))  # fmt: skip
        for bits in a.exllamav2_bits:
            names = _exllamav2_run_names(calib, bits, a.exllamav2_runs)
            for label, name, meas in names:
                out, emeas = work / name, work / f"{meas}.json"
                record(label, out, partial(_exllamav2, src, out, bits, emeas, e_cal, a))
            if len(names) > 1:
                runs = [rows[n[0]] for n in names]
                if len({str(r.get("scored")) for r in runs}) > 1:  # rows of earlier calls
                    raise SystemExit(f"exllamav2 {calib} {bits:g}: its runs were scored with "
                                     "different --window/--windows; score them again")  # fmt: skip
                achieved = [r["bpw"] for r in runs if r.get("bpw") is not None]
                rows[f"exllamav2 {calib} {bits:g} median"] = {
                    "ppl": median_row([r["ppl"] for r in runs]),
                    "bpw": statistics.median(achieved) if achieved else None,
                    "runs": [n[0] for n in names],
                }
                if a.json:
                    Path(a.json).write_text(json.dumps(results, indent=1))
    print(f"\n{a.windows} windows of {a.window} tokens a domain, {bos_words(None)}\n")
    print(domain_table({label: row["ppl"] for label, row in rows.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
