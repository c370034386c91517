"""Where a tensor-parallel load's time goes, against one device's load (issue 33).

    python tools/profile_tp_load.py MODEL_DIR --mode tp [--device cuda] [--tp 2] \
        [--prestart] [--t0 EPOCH] [--cprofile DIR] [--json FILE]

Loads MODEL_DIR once, in this process, either on one device (`--mode single`: Engine.load)
or with tensor parallelism (`--mode tp`: launch_tensor_parallel over --tp ranks, rank r on
cuda:r, or gloo ranks with --device cpu), as tools/multigpu_check.py does (float16 on a
GPU, CUDA graphs on). Prints the load's wall time and, for tp, every rank's load phases
(engine/tensor_parallel/load_phases.py: start-up and imports, the shard's reads and cut
with the bytes and read calls of the weight files, the move to the device, joining the
group, the all-reduce set-up, the cache), then unloads. One load per process: a second
would find the first one's caches; run the command again for a warm load.

--prestart starts the other ranks before this process imports torch (spawned.prestart, as
the CLI does for --tp N), so their imports and this one's overlap. --t0: the shell's
`date +%s.%N` before the command, to report the time since then as well (process start,
imports included). --cprofile DIR: cProfile of rank 0's load and of rank 1's (up to the
point it is ready), written as DIR/rank<r>.prof with the 25 largest entries printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Top-level code also runs in each spawned rank (multiprocessing re-imports this script as
# __mp_main__ there): stdlib only, and the rank's profiler when asked for.
_PROFILE_DIR_ENV = "KESTREL_TP_LOAD_CPROFILE"


def _profile_spawned_rank(directory: str) -> None:
    """In a spawned rank: profile from here until it has exchanged its load reports."""
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    import engine.tensor_parallel.rank as rank_module

    exchange = rank_module.exchange_rank_reports

    def exchange_then_dump(memory, phases):  # type: ignore[no-untyped-def]
        try:
            return exchange(memory, phases)
        finally:
            profile.disable()
            profile.dump_stats(os.path.join(directory, f"rank{os.getpid()}.prof"))

    rank_module.exchange_rank_reports = exchange_then_dump


if __name__ == "__mp_main__" and os.environ.get(_PROFILE_DIR_ENV):
    _profile_spawned_rank(os.environ[_PROFILE_DIR_ENV])


def _print_profile(path: str, title: str) -> None:
    import pstats

    print(f"--- cProfile {title} (by internal time)")
    pstats.Stats(path).sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--mode", choices=("single", "tp"), required=True)
    parser.add_argument("--tp", type=int, default=2, help="ranks for --mode tp")
    parser.add_argument("--device", default="cuda", help="cuda or cpu (gloo ranks)")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--prestart", action="store_true")
    parser.add_argument("--t0", type=float, default=None)
    parser.add_argument("--cprofile", default=None, help="directory for the ranks' profiles")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if args.mode == "tp" and args.prestart:
        from engine.tensor_parallel.spawned import prestart

        if args.cprofile:
            os.environ[_PROFILE_DIR_ENV] = args.cprofile
        prestart(args.tp)
    started_imports = time.time()
    import torch  # noqa: F401 - timed: what a process pays before its load

    from engine.engine import Engine, EngineOptions
    from engine.tensor_parallel.launch import launch_tensor_parallel
    from engine.tensor_parallel.load_phases import format_phases

    imports_s = time.time() - started_imports
    cuda = args.device.startswith("cuda")
    options = EngineOptions(
        device="cuda:0" if cuda and args.mode == "single" else args.device,
        dtype="float16" if cuda else None,
        max_seq_len=args.max_seq_len,
    )
    profile = None
    if args.cprofile:
        import cProfile

        os.makedirs(args.cprofile, exist_ok=True)
        os.environ[_PROFILE_DIR_ENV] = args.cprofile  # ranks spawned by the launch
        profile = cProfile.Profile()
        profile.enable()
    started = time.time()
    if args.mode == "single":
        engine = Engine.load(args.model, options)
    else:
        engine = launch_tensor_parallel(args.model, options, args.tp)
    ready = time.time()
    if profile is not None:
        profile.disable()
    result: dict[str, object] = {
        "mode": args.mode,
        "model": args.model,
        "load_s": round(ready - started, 3),
        "imports_s": round(imports_s, 3),
    }
    if args.t0 is not None:
        result["since_t0_s"] = round(ready - args.t0, 3)
    line = f"{args.mode} load {result['load_s']:.2f} s (imports before it {imports_s:.2f} s"
    if args.t0 is not None:
        line += f"; {result['since_t0_s']:.2f} s since the command started"
    print(line + ")", flush=True)
    if args.mode == "tp":
        phases = engine.runner.ranks.load_phases  # type: ignore[attr-defined]
        result["phases"] = phases
        print(format_phases(phases), flush=True)
    engine.unload()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if profile is not None:
        path = os.path.join(args.cprofile, "rank0-load.prof")
        profile.dump_stats(path)
        _print_profile(path, "rank 0")
        for name in sorted(os.listdir(args.cprofile)):
            if name.startswith("rank") and name != "rank0-load.prof" and name.endswith(".prof"):
                _print_profile(os.path.join(args.cprofile, name), f"spawned rank ({name})")
    return 0


if __name__ == "__main__":  # the launch spawns ranks, which import this script again
    sys.exit(main())
