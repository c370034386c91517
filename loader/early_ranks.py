"""Starting a tensor-parallel load's other ranks before this process imports torch.

A spawned rank spends its first seconds importing torch, Triton and the engine (3.8 to 5.4 s
of a 70B TP=2 load on 2x H100, issue 33), and rank 0 waits for it in the end. Whoever knows
early that a load will be tensor parallel over N ranks of this machine starts them here
(engine/tensor_parallel/spawned.py's prestart), before it imports anything heavy itself:
`loader.load(..., tp=N)`, the CLI's `--tp N` and the API server's `--model ... --tp N`. The
launch takes them; a load that does not take them stops them (`discard`).

Nothing here imports torch or the engine beyond the two small modules below (a test checks
it): the point is to run before those imports.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from engine.tensor_parallel import spawned
from engine.tensor_parallel.launched import launched_rank


def prestart_for(tp: object, loader_name: str | None) -> bool:
    """Start ranks 1..tp-1 for a load with `tp=tp` by `loader_name` (None: detected), when it
    will spawn them: Kestrel's loader (or none named), tp a whole number above 1, not under
    torchrun (whose ranks exist already). True when this call started them."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 2:
        return False
    if loader_name not in (None, "kestrel") or launched_rank() is not None:
        return False
    if spawned.has_prestarted():
        return False  # the caller's own, left for the launch to take
    spawned.prestart(tp)
    return True


def prestart_from_argv(argv: Sequence[str], *, model_flag: str | None = None) -> bool:
    """prestart_for the `--tp N` and `--loader` of a command line (loader/placement_args.py's
    flags), read before the full parser is built (building it lists the loaders, which
    imports torch). `model_flag`: a flag without which the command loads no model at start
    (the API server's --model). A malformed command line starts nothing: the full parser
    says what is wrong."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    early.add_argument("--tp", type=int, nargs="?", const=0, default=None)
    early.add_argument("--loader", default=None)
    if model_flag is not None:
        early.add_argument(model_flag, dest="model", default=None)
    try:
        known, _ = early.parse_known_args(list(argv))
    except argparse.ArgumentError:
        return False
    if model_flag is not None and not known.model:
        return False
    return prestart_for(known.tp, known.loader)


def discard() -> None:
    """Stop prestarted ranks that no launch took (the load failed, or went another way)."""
    spawned.discard_prestarted()
