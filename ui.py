"""Kestrel's web UI: `python ui.py` and open http://127.0.0.1:7860.

With no flags it loads the model used last time, or the default model (prepared on first
use), and serves on 127.0.0.1 only. Flags are modelled on text-generation-webui's; see
`python ui.py --help` and webui/cli.py. The tabs live in webui/.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# No usage reporting and no update checks from a local tool (must precede the import).
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from webui import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_args(argv)
    # Before anything slow: a port in use or a model that cannot be had ends here, in seconds.
    problem = _port_problem(args)
    if problem:
        print(f"[kestrel ui] {problem}", file=sys.stderr, flush=True)
        return 2
    if args.model:  # a name, a path or a Hugging Face id (downloaded here, once)
        from loader.hub import ModelSourceError, resolve_model

        try:
            path = resolve_model(args.model, args.models_dir)
        except ModelSourceError as e:
            print(f"[kestrel ui] --model: {e}", file=sys.stderr, flush=True)
            return 2
        args.model = path.name if path.parent == Path(args.models_dir) else str(path)

    from loader.manager import ModelManager
    from serving import extensions, shared
    from serving.sessions import UserData
    from webui import startup
    from webui.context import AppContext

    shared.args = args
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    shared.manager = ModelManager(args.models_dir, args.loras_dir)
    user_data = UserData(args.user_data_dir)
    remembered = user_data.load_settings()
    shared.settings.update(remembered.get("parameters") or {})
    ctx = AppContext(shared.manager, user_data, args)
    # TGW extensions stop the UI's generation with shared.stop_everything (serving/shared.py).
    shared.stop_all_replies = ctx.stop_all

    if startup.prepare_while_serving(args, shared.manager):
        # Minutes of work: the page is served meanwhile and shows the progress.
        startup.start_preparing(args, shared.manager, remembered)
    else:
        startup.load_initial_model(args, shared.manager, remembered)
        startup.apply_startup_loras(args, ctx)
    if args.extensions:
        extensions.load_extensions(args.extensions)
    if args.api:
        from webui.api_server import start_api

        start_api(args, block=args.nowebui)
        if args.nowebui:
            return 0

    from webui.app import build_app, launch_kwargs

    demo = build_app(ctx)
    # Handlers share one model; generation handlers set their own (unlimited) limit and
    # are batched by the scheduler, everything else runs a few at a time.
    demo.queue(default_concurrency_limit=4)
    # quiet: Gradio's own banner suggests `share=True` in launch(); ui.py has --share.
    demo.launch(
        server_name=cli.host(args),
        server_port=args.port,
        share=args.share,
        inbrowser=args.inbrowser,
        ssr_mode=False,
        show_error=True,
        quiet=True,
        prevent_thread_lock=True,
        **launch_kwargs(ctx),
    )
    print(f"[kestrel ui] serving on {demo.local_url}", file=sys.stderr, flush=True)
    if args.share:
        print(f"[kestrel ui] public link: {demo.share_url}", file=sys.stderr, flush=True)
    else:
        print("[kestrel ui] (--share makes a public gradio.live link)", file=sys.stderr, flush=True)
    demo.block_thread()
    return 0


def _port_problem(args: argparse.Namespace) -> str | None:
    """Why the web UI's or the API's port cannot be served on, naming the flag; else None."""
    from serving.ports import port_problem

    host = cli.host(args)
    wanted = [] if args.nowebui else [(args.port, "--port")]
    if args.api or "openai" in args.extensions:  # the extension is the API server (TGW's way)
        wanted.append((args.api_port, "--api-port"))
    if len(wanted) == 2 and args.port == args.api_port and args.port != 0:
        return f"--port and --api-port are both {args.port}: give them different ports"
    for port, flag in wanted:
        problem = port_problem(host, port, flag)
        if problem:
            return problem
    return None


if __name__ == "__main__":
    sys.exit(main())
