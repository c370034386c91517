"""Where a model's layers go, as command-line flags: one definition for every command that
loads a model (`python -m loader`, `python -m extensions.openai`), so that `--tp`,
`--gpu-split` and the rest mean the same everywhere."""

from __future__ import annotations

import argparse
from typing import Any


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Layer split, CPU offload and tensor parallelism flags."""
    parser.add_argument(
        "--gpu-split",
        default=None,
        help="layer split: GiB per GPU, comma-separated (e.g. 20,24)",
    )
    parser.add_argument(
        "--autosplit", action="store_true", help="layer split from each GPU's free memory"
    )
    parser.add_argument(
        "--gpu-reserve", type=float, default=None, help="GiB left free per GPU (auto split)"
    )
    parser.add_argument(
        "--cpu-offload", action="store_true", help="run layers that fit no GPU on the CPU"
    )
    parser.add_argument(
        "--tp",
        type=int,
        nargs="?",
        const=0,
        default=None,
        metavar="N",
        help="tensor parallel over N GPUs (one process each); without N: every GPU, or every "
        "rank when started by torchrun (several machines: see the README)",
    )


def placement_options(args: argparse.Namespace) -> dict[str, Any]:
    """The loader options of the flags above; only those given (other loaders do not know
    them)."""
    out: dict[str, Any] = {}
    if args.gpu_split:
        try:
            out["gpu_split"] = [float(v) for v in args.gpu_split.split(",")]
        except ValueError:
            raise ValueError(
                f"--gpu-split takes GiB per GPU like 20,24; got {args.gpu_split!r}"
            ) from None
    if args.autosplit:
        out["autosplit"] = True
    if args.gpu_reserve is not None:
        out["gpu_reserve_gb"] = args.gpu_reserve
    if args.cpu_offload:
        out["cpu_offload"] = True
    if args.tp:
        out["tp"] = args.tp
    elif args.tp == 0:  # --tp without N
        out["tensor_parallel"] = True
    return out
