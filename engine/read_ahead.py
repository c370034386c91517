"""Read the next item of a load while the current one is built.

A 70B tensor-parallel rank read its quantized linears for 4.8 s and repacked them for 2.1 s,
one after the other (2x H200, issue 33): each repack starts with reads of the GPU (the
group checks, the zero points' width), which wait for the piece's last copies, and
nothing was read meanwhile. Here one worker thread reads item i+1 while the caller's thread
builds item i. Reading mostly sits in os.preadv and copies that let go of the GIL, and
building in kernels and their waits, so the two overlap.

Both threads queue their GPU work on the device's current stream: a piece's copies always
come before the kernels that build it (they were queued before its read returned), and a
block the caller frees is reused by the worker's allocations in stream order. The worker
allocates outside any memory pool the caller's thread routes to (torch.cuda.use_mem_pool
covers one thread): on a tensor-parallel rank the pieces read land in the common pool and
the repacked, cut parts in the staging pool (engine/tensor_parallel/staging.py).

KESTREL_LOAD_READ_AHEAD=0 reads and builds on one thread, as before (a measurement's other
arm).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

Item = TypeVar("Item")
Read = TypeVar("Read")
Built = TypeVar("Built")


def read_ahead_enabled() -> bool:
    return os.environ.get("KESTREL_LOAD_READ_AHEAD", "1") != "0"


def read_ahead(
    items: Sequence[Item],
    read: Callable[[Item], Read],
    build: Callable[[Item, Read], Built],
) -> list[Built]:
    """[build(item, read(item)) for item in items], in order, with read(items[i + 1]) running
    on a worker thread while build(items[i], ...) runs on this one. `read` must not use what
    `build` changes (the worker and this thread run at once); the worker is done (ended or
    cancelled) when this returns or raises, so the caller may use what `read` used after.
    The first error raised, by either, is raised here."""
    if len(items) < 2 or not read_ahead_enabled():
        return [build(item, read(item)) for item in items]
    device = _current_cuda_device()
    results: list[Built] = []
    with ThreadPoolExecutor(
        1, thread_name_prefix="kestrel-read-ahead", initializer=_use_device, initargs=(device,)
    ) as worker:
        pending: Future[Read] = worker.submit(read, items[0])
        try:
            for i, item in enumerate(items):
                data = pending.result()
                if i + 1 < len(items):
                    pending = worker.submit(read, items[i + 1])
                results.append(build(item, data))
        except BaseException:
            pending.cancel()  # not started: dropped; running: the pool's exit waits for it
            raise
    return results


def _current_cuda_device() -> int | None:
    """This thread's CUDA device, where CUDA is in use: a new thread starts on device 0, and
    a rank on cuda:1 would otherwise make a context on GPU 0 (pinned buffers, events)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def _use_device(device: int | None) -> None:
    if device is not None:
        torch.cuda.set_device(device)
