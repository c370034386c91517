"""Convert an FP16/BF16 Hugging Face model (or a GGUF file) to EXL2.

    python convert.py -i models/fp16 -o models/exl2-4.0 -b 4.0
    python convert.py -i model.gguf -o work -c my_text.jsonl -om measurement.json  # measure
    python convert.py -i models/fp16 -o out-5.0 -b 5.0 -m measurement.json   # reuse it

Flags follow exllamav2's convert.py (-om measures only and stops, as there). The work
happens in OUT.partial/; rerunning the same command after a kill resumes it, -nr starts
over. OUT appears only when complete. Exit status 0 on success, 2 on bad input (message
on stderr, nothing written), 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

from engine.quantizer import ConvertError, ConvertOptions, convert
from engine.quantizer.gptq import DEFAULT_DAMP
from engine.quantizer.optimize import DEFAULT_NORM
from engine.quantizer.pipeline import (
    DEFAULT_ROWS,
    FAST_ROWS,
    MAX_NORM,
    MAX_TOKEN_POWER,
    MIN_NORM,
)
from engine.quantizer.sensitivity import SENSITIVITIES
from engine.quantizer.shrink_choice import SHRINK_LADDER


def _rows_text(table: dict[str, tuple[int, int, int, int]], device: str) -> str:
    r, ln, mr, ml = table[device]
    return f"{r}x{ln} ({mr}x{ml} measuring)"


FAST_HELP = (
    "quick try: fewer, shorter calibration rows, and on a CPU measurement candidates scored "
    "on their first 1024 tokens only (about half the time of the default on a CPU, slightly "
    f"higher perplexity): {_rows_text(FAST_ROWS, 'cpu')} on a CPU, "
    f"{_rows_text(FAST_ROWS, 'cuda')} on a GPU, instead of the quality-first "
    f"{_rows_text(DEFAULT_ROWS, 'cpu')} and {_rows_text(DEFAULT_ROWS, 'cuda')} "
    "(rows x tokens); -r/-l/-mr/-ml still override"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Quantize a model to EXL2 (ExLlamaV2's format) at any bits per weight."
    )
    p.add_argument("-i", "--in_dir", required=True, help="FP16/BF16 HF model dir or .gguf file")
    p.add_argument("-o", "--out_dir", required=True, help="output directory (must not exist)")
    p.add_argument("-b", "--bits", type=float, help="target bits per weight (2.0-8.0)")
    p.add_argument("-hb", "--head_bits", type=int, default=6, help="lm_head bits (default 6)")
    p.add_argument(
        "-c",
        "--cal_dataset",
        nargs="+",
        help="calibration text: .txt, .jsonl or .parquet file(s), one source each, their rows "
        "taking turns (default: the shipped mix of wiki, web, code, multilingual, chat and "
        "story text, engine/quantizer/data/README.md)",
    )
    p.add_argument("-r", "--dataset_rows", type=int, help="calibration rows to quantize")
    p.add_argument("-mr", "--measurement_rows", type=int, help="calibration rows to measure")
    p.add_argument("-l", "--length", type=int, help="tokens per calibration row")
    p.add_argument("-ml", "--measurement_length", type=int, help="tokens per measurement row")
    p.add_argument("--fast", action="store_true", help=FAST_HELP)
    p.add_argument(
        "-om", "--output_measurement", help="measure only, save the measurement here, stop"
    )
    p.add_argument("-m", "--measurement", help="reuse a saved measurement (skips measuring)")
    p.add_argument("-ss", "--shard_size", type=int, default=8192, help="max shard size, MB")
    p.add_argument("-nr", "--no_resume", action="store_true", help="start over, drop OUT.partial")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument(
        "--threads", type=int, help="CPU threads for torch (default: the idle cores, on a CPU)"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "-d",
        "--damp",
        type=float,
        default=DEFAULT_DAMP,
        help="GPTQ damping, a fraction of the Hessian's mean diagonal added to it (default "
        f"{DEFAULT_DAMP:g}; exllamav2 uses 0.12). More damping trusts the calibration "
        "inputs' correlations less. With -m it applies to the quantization pass only",
    )
    p.add_argument(
        "--shrink",
        type=_shrink_arg,
        default=None,
        metavar="auto|S",
        help="GPTQ Hessian shrinkage toward its diagonal: H + S * diag(H) before the damping "
        "(0: plain GPTQ). Correlations between inputs seen in one kind of text may not hold "
        "in others; shrinking them keeps GPTQ from leaning on them, which helps some models "
        f"and costs others. auto: quantize at {_ladder()} (the next only while the last "
        "helped) and keep the one whose held-out calibration rows read best: two or three "
        "quantizing passes instead of one (about 1.5x a whole conversion; 2-3x with -m, "
        "where quantizing is all the work). Default: auto with your own text (-c), 0 with "
        "the shipped mix, --fast or --rtn. With -m it applies to the quantization pass only",
    )

    p.add_argument(
        "--error_norm",
        type=float,
        default=DEFAULT_NORM,
        help="the bit allocation minimizes the sum of the measured module errors to this "
        f"power (default {DEFAULT_NORM:g}, the total noise; {MIN_NORM:g}-{MAX_NORM:g}). Higher "
        "values weigh the worst modules more and spread the bits more evenly, a hedge "
        "when the calibration text differs from what the model will read",
    )
    p.add_argument(
        "--error_reference",
        choices=("layer", "module"),
        default="layer",
        help="what a measured module's output error is divided by: the residual stream after "
        "the whole layer (layer, the default) or right after that module (module, as "
        "exllamav2 does: an attention is judged against the stream it writes into, not "
        "against the MLP's output that follows it). Measuring only, so not with -m",
    )
    p.add_argument(
        "--heldout_scoring",
        "--heldout-scoring",
        type=float,
        default=0.0,
        metavar="F",
        help="score each measured candidate on the last fraction F of the measuring rows, "
        "with its GPTQ Hessian from the rows before them, so that the allocation does not "
        "favour what fits the calibration text itself (0 < F < 1, e.g. 0.5; default 0: "
        "Hessians and scores from every row, as exllamav2). Measuring only, so not with -m",
    )
    p.add_argument(
        "--token_power",
        "--token-power",
        type=float,
        default=1.0,
        metavar="Q",
        help="score each measured candidate by the power mean of power Q of its tokens' "
        "squared relative errors instead of their mean, weighing the tokens a module gets "
        "most wrong more than the calibration text's common ones: a hedge when the model "
        f"will read text unlike the calibration text (1-{MAX_TOKEN_POWER:g}, e.g. 2; "
        "default 1: the mean). Measuring only, so not with -m",
    )
    p.add_argument(
        "--sensitivity",
        choices=SENSITIVITIES,
        default="kl",
        help="how the bit allocation weighs each module's measured error: kl (the default) "
        "by what its noise costs at the model's output, probed while measuring on a few "
        "calibration rows (the KL divergence of the next-token distribution when that "
        "module alone is quantized to 4 bits); off: as measured. With -m, kl uses the "
        "probe the measurement holds (none in files made with off)",
    )
    p.add_argument(
        "--rtn",
        action="store_true",
        help="round to nearest instead of GPTQ, same bit allocation (a baseline to compare)",
    )
    return p.parse_args(argv)


def _shrink_arg(text: str) -> float | str:
    """--shrink: "auto" (chosen per model) or a number."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number, got {text!r}") from None


def _ladder() -> str:
    return ", ".join(f"{s:g}" for s in SHRINK_LADDER)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bits is None and not args.output_measurement:
        print("convert.py: error: -b/--bits is required (except with -om)", file=sys.stderr)
        return 2
    options = ConvertOptions(
        # A measurement does not depend on the target; any valid value serves with -om.
        bits=args.bits if args.bits is not None else 4.0,
        head_bits=args.head_bits,
        calibration=args.cal_dataset,
        rows=args.dataset_rows,
        length=args.length,
        measure_rows=args.measurement_rows,
        measure_length=args.measurement_length,
        measurement_out=args.output_measurement,
        measure_only=bool(args.output_measurement),
        measurement_in=args.measurement,
        fast=args.fast,
        shard_mb=args.shard_size,
        resume=not args.no_resume,
        device=args.device,
        progress=not args.quiet,
        rtn=args.rtn,
        damp=args.damp,
        shrink=args.shrink,
        error_norm=args.error_norm,
        error_reference=args.error_reference,
        heldout=args.heldout_scoring,
        token_power=args.token_power,
        sensitivity=args.sensitivity,
        threads=args.threads,
    )
    try:
        result = convert(args.in_dir, args.out_dir, options)
    except ConvertError as e:
        print(f"convert.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"\nconvert.py: interrupted; rerun the same command to resume ({args.out_dir}.partial)",
            file=sys.stderr,
        )
        return 130
    if result.output is None:
        print(f"{args.output_measurement}: measurement saved in {result.seconds:.0f} s")
    else:
        print(f"{result.output}: {result.bpw:.4f} bpw in {result.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
