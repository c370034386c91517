"""The API without the web UI: `python -m extensions.openai --model NAME_OR_PATH`.

    python -m extensions.openai --model SmolLM2-135M-Instruct-fp16 --models-dir models
    python -m extensions.openai --model /data/llama-3-8b-exl2 --listen --api-key secret

The model is a name in --models-dir or a path to a model directory; without --model the
server starts with none loaded (load one through /v1/internal/model/load). --extensions
loads TGW-style extensions (extensions/<name>/script.py) whose hooks apply to API requests.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import loader
from extensions.openai.load_defaults import with_cache_default
from extensions.openai.server import run_api_server
from loader.hub import resolve_model
from loader.manager import ModelManager, UnknownNameError
from loader.program_name import program_name
from serving import extensions, shared
from serving.ports import port_problem


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program_name("python -m extensions.openai"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        help="a name in --models-dir, a model directory, or a Hugging Face id (owner/name, or "
        "owner/name:branch) downloaded into --models-dir once",
    )
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--loras-dir", type=Path, default=Path("loras"))
    parser.add_argument("--loader", default=None, choices=loader.available())
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: a GPU)")
    parser.add_argument("--dtype", default=None, help="float16, bfloat16 or float32")
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument(
        "--cache-tokens", type=int, default=None,
        help="KV cache size in tokens, shared by concurrent requests (kestrel loader)",
    )  # fmt: skip
    parser.add_argument(
        "--cache-memory-fraction", type=float, default=None,
        help="without --cache-tokens: the share of free GPU memory the KV cache takes (0.9)",
    )  # fmt: skip
    parser.add_argument("--listen", action="store_true", help="bind 0.0.0.0, not 127.0.0.1")
    parser.add_argument("--listen-host", default=None, help="the address --listen binds")
    parser.add_argument("--port", "--api-port", dest="port", type=int, default=5000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--admin-key", default=None,
        help="key for /v1/internal model and LoRA loading (default: the API key)",
    )  # fmt: skip
    parser.add_argument(
        "--cors-origins", "--api-cors-origins", dest="cors_origins", default="",
        help="comma-separated origins allowed by CORS (default: CORS off)",
    )  # fmt: skip
    parser.add_argument("--extensions", nargs="*", default=[], help="TGW-style extensions")
    return parser


def load_model(manager: ModelManager, args: argparse.Namespace) -> None:
    options = {
        k: v
        for k, v in {
            "device": args.device,
            "dtype": args.dtype,
            "max_seq_len": args.max_seq_len,
            "cache_tokens": args.cache_tokens,
        }.items()
        if v is not None
    }
    fraction = args.cache_memory_fraction
    try:
        path = manager.resolve_model(args.model)
    except UnknownNameError:
        path = Path(args.model).expanduser()
        if not path.exists():
            raise
        options = with_cache_default(options, path, args.loader, fraction)
        manager.adopt(loader.load(path, args.loader, **options), path.name)
        return
    options = with_cache_default(options, path, args.loader, fraction)
    manager.load(args.model, args.loader, **options)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    manager = ModelManager(args.models_dir, args.loras_dir)
    shared.manager = manager
    shared.args = args
    host = (args.listen_host or "0.0.0.0") if args.listen else "127.0.0.1"
    problem = port_problem(host, args.port, "--port")  # before the (slow) model load
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.model:
        try:
            path = resolve_model(args.model, args.models_dir)  # a Hub id: downloaded here
            args.model = path.name if path.parent == args.models_dir else str(path)
            load_model(manager, args)
        except (ValueError, OSError) as error:
            print(f"error: cannot load {args.model!r}: {error}", file=sys.stderr)
            return 2
        print(f"model: {manager.name}", file=sys.stderr)
    extensions.load_extensions([e for e in args.extensions if e != "openai"])
    origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()]
    run_api_server(
        host, args.port, args.api_key, args.admin_key, block=True, manager=manager,
        cors_origins=origins, log_level="info",
    )  # fmt: skip
    manager.unload()
    return 0


if __name__ == "__main__":
    sys.exit(main())
