"""ui.py's command line, modelled on text-generation-webui's flags.

TGW spells some flags with underscores (--max_seq_len, --cache_type); both spellings are
accepted. The server binds to 127.0.0.1 unless --listen is given, and is never shared
through a public gradio.live link unless --share is given.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from loader.program_name import program_name

CACHE_TYPES = ("fp16", "fp8", "q8", "q6", "q4")
# Folders default to the checkout's, wherever ui.py is started from (as TGW does).
ROOT = Path(__file__).resolve().parent.parent


def parse_gpu_split(text: str | None) -> list[float] | None:
    """TGW's --gpu-split "20,24": GiB to use on each GPU, in order. None or "" means no split.
    Raises ValueError naming the bad part."""
    if text is None or not str(text).strip():
        return None
    parts = [p.strip() for p in str(text).replace(";", ",").split(",")]
    out = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise ValueError(
                f"gpu_split must be GiB per GPU separated by commas, like 20,24; "
                f"{part!r} is not a number"
            ) from None
        if not value > 0:
            raise ValueError(f"gpu_split: every GPU needs more than 0 GiB, got {part!r}")
        out.append(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=program_name("python ui.py"),
        description="Kestrel web UI: chat, notebook, parameters, models and LoRAs in a browser.",
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        help="model to load at start: a name in --models-dir, a path, or a Hugging Face id "
        "(owner/name, or owner/name:branch) downloaded into --models-dir once. Without it: the "
        "model loaded last time, else the default model (prepared on first use)",
    )
    m.add_argument("--models-dir", "--model-dir", type=Path, default=ROOT / "models",
                   help="default: models/ beside ui.py")  # fmt: skip
    m.add_argument("--loras-dir", "--lora-dir", type=Path, default=ROOT / "loras",
                   help="default: loras/ beside ui.py")  # fmt: skip
    m.add_argument("--lora", nargs="+", default=[], help="LoRA names to load with the model")
    m.add_argument("--loader", help="kestrel, transformers, ... (default: picked from the files)")
    m.add_argument("--device", help="cpu, cuda, cuda:1 (default: the first GPU, else cpu)")
    m.add_argument("--dtype", help="float16, bfloat16, float32")
    m.add_argument("--max-seq-len", "--max_seq_len", type=int, help="context length in tokens")
    m.add_argument("--cache-type", "--cache_type", choices=CACHE_TYPES, default="fp16")
    m.add_argument("--gpu-split", "--gpu_split", help="GiB per GPU, e.g. 20,24")
    m.add_argument("--autosplit", action="store_true", help="fill GPUs in order automatically")
    m.add_argument(
        "--tp",
        "--tensor-parallel",
        dest="tp",
        action="store_true",
        help="tensor parallel over the GPUs",
    )
    m.add_argument("--rope-alpha", "--alpha_value", type=float, help="NTK RoPE alpha")
    m.add_argument(
        "--rope-scale",
        "--compress_pos_emb",
        type=float,
        help="linear RoPE scale (positions compressed by this factor)",
    )
    m.add_argument(
        "--threads",
        type=int,
        help="CPU threads for generation and for preparing the default model "
        "(default: torch's choice for generation, the idle cores for the conversion)",
    )
    m.add_argument(
        "--no-default-model",
        action="store_true",
        help="start with no model instead of preparing the default one",
    )
    s = p.add_argument_group("server")
    s.add_argument("--listen", action="store_true", help="listen on all interfaces (0.0.0.0)")
    s.add_argument("--listen-host", help="the interface --listen binds to")
    s.add_argument("--port", "--listen-port", type=int, default=7860)
    s.add_argument("--share", action="store_true", help="public gradio.live link (off by default)")
    s.add_argument("--api", action="store_true", help="also start the OpenAI-compatible API")
    s.add_argument("--api-port", type=int, default=5000)
    s.add_argument("--api-key", default="", help="key the API requires (default: none)")
    s.add_argument("--admin-key", default="", help="key for model loading through the API")
    s.add_argument(
        "--cors-origins", "--api-cors-origins", dest="cors_origins", default="",
        help="comma-separated origins the API allows by CORS (default: CORS off)",
    )  # fmt: skip
    s.add_argument("--nowebui", action="store_true", help="start only the API, no web UI")
    s.add_argument("--extensions", nargs="+", default=[], help="extensions/<name> to load")
    s.add_argument(
        "--user-data-dir",
        type=Path,
        default=ROOT / "user_data",
        help="saved chats, presets and settings (default: user_data/ beside ui.py)",
    )
    s.add_argument("--inbrowser", action="store_true", help="open the UI in a browser tab")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.gpu_split_list = parse_gpu_split(args.gpu_split)
    except ValueError as e:
        parser.error(str(e))
    if args.nowebui:
        args.api = True
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be 1 or more, got {args.threads}")
    return args


def host(args: argparse.Namespace) -> str:
    if args.listen:
        return args.listen_host or "0.0.0.0"
    return "127.0.0.1"


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """The loader.load keyword arguments the flags ask for (unset flags left out)."""
    options: dict[str, Any] = {}
    if args.cache_type != "fp16":
        options["cache_type"] = args.cache_type
    for key, value in (
        ("device", args.device),
        ("dtype", args.dtype),
        ("max_seq_len", args.max_seq_len),
        ("gpu_split", args.gpu_split_list),
        ("rope_alpha", args.rope_alpha),
        ("rope_scale", args.rope_scale),
    ):
        if value is not None:
            options[key] = value
    if args.autosplit:
        options["autosplit"] = True
    if args.tp:
        options["tensor_parallel"] = True
    return options
