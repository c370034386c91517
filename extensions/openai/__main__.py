"""The API without the web UI: `python -m extensions.openai --model NAME_OR_PATH`.

    python -m extensions.openai --model SmolLM2-135M-Instruct-fp16 --models-dir models
    python -m extensions.openai --model /data/llama-3-8b-exl2 --listen --api-key secret

The model is a name in --models-dir or a path to a model directory; without --model the
server starts with none loaded (load one through /v1/internal/model/load). --extensions
loads TGW-style extensions (extensions/<name>/script.py) whose hooks apply to API requests.

One model over several GPUs or machines, with ranks torchrun starts (rank 0 serves HTTP;
the others serve rank 0 until it unloads at shutdown):

    torchrun --nnodes 1 --nproc-per-node 2 -m extensions.openai --model NAME --tp
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from types import FrameType

import loader
from extensions.openai.load_defaults import with_cache_default
from extensions.openai.server import run_api_server
from loader import early_ranks
from loader.hub import resolve_model
from loader.manager import ModelManager, UnknownNameError
from loader.placement_args import add_placement_arguments, placement_options
from loader.program_name import program_name
from loader.torchrun import LaunchedRank, launched_rank
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
    add_placement_arguments(parser)
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
    options.update(placement_options(args))
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


# Why /v1/internal/model/load and unload are refused under torchrun.
PINNED = (
    "this server runs one model over the ranks torchrun started (--tp under torchrun); "
    "they cannot be started again for another model: restart torchrun with the new --model"
)


def _torchrun_problem(args: argparse.Namespace, launched: LaunchedRank) -> str | None:
    if args.tp is None:
        return (
            f"started by torchrun (rank {launched.rank} of {launched.world_size}) without "
            "--tp: give --tp to run one model over torchrun's ranks"
        )
    if not args.model:
        return "under torchrun, --model is needed: its ranks load it at start"
    return None


def _serve_rank(args: argparse.Namespace) -> int:
    """A rank > 0 of torchrun: no port, no server; this machine's copy of the model, loaded
    with rank 0's options (rank 0 sends them), served to rank 0 until it unloads."""
    from loader.kestrel_loader import serve_tensor_parallel_rank

    try:
        serve_tensor_parallel_rank(resolve_model(args.model, args.models_dir))
    except (ValueError, OSError) as error:
        print(f"error: cannot serve {args.model!r}: {error}", file=sys.stderr)
        return 2
    print("rank 0 unloaded the model: this rank stops", file=sys.stderr)
    return 0


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # After the server stops, uvicorn raises the signal it caught again; SIGTERM's default
    # would end the process before the model is unloaded (which stops torchrun's ranks).
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    # --model with --tp N: the other ranks start first, so that their start-up (seconds of
    # imports) runs beside this process's port check, model resolution and load set-up.
    early_ranks.prestart_from_argv(sys.argv[1:] if argv is None else argv, model_flag="--model")
    try:
        return _main(argv)
    finally:
        early_ranks.discard()  # ranks that no load took (it failed, or went another way)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    launched = launched_rank()
    if launched is not None:
        problem = _torchrun_problem(args, launched)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        if launched.rank > 0:
            return _serve_rank(args)
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
    if launched is not None:
        manager.pin(PINNED)
    try:
        extensions.load_extensions([e for e in args.extensions if e != "openai"])
        origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()]
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
        run_api_server(
            host, args.port, args.api_key, args.admin_key, block=True, manager=manager,
            cors_origins=origins, log_level="info",
        )  # fmt: skip
    except KeyboardInterrupt:  # Ctrl+C: uvicorn stopped the server and raised it again
        pass
    finally:
        manager.unload()  # under torchrun this stops the other ranks
        print("model unloaded", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
