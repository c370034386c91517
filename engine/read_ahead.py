"""Read the next item of a load while the current one is built.

A 70B tensor-parallel rank read its quantized linears for 4.8 s and repacked them for 2.1 s,
one after the other (2x H200, issue 33): each repack starts with reads of the GPU (the
group checks, the zero points' width), which wait for the piece's last copies, and
nothing was read meanwhile. Here one worker thread reads item i+1 while the caller's thread
builds item i. Reading mostly sits in os.preadv and copies that let go of the GIL, and
building in kernels and their waits, so the two overlap.

The worker queues its GPU work on the caller's current stream (and device): a piece's
copies always come before the kernels that build it (they were queued before its read
returned), and the worker's allocations and the caller's frees are ordered on that one
stream. The builds' waits on the GPU therefore also wait for the next piece's copies queued
so far; a copy stream of the worker's own would take that out (not done: it needs an event
wait before each build and record_stream on every piece). A memory pool the caller's
thread routes its allocations to (torch.cuda.use_mem_pool covers one thread) does not get
the worker's: on a tensor-parallel rank the pieces read, and the shards that are such a
piece unchanged, land in the common pool, and what the build makes in the staging pool
(engine/tensor_parallel/staging.py).

KESTREL_LOAD_READ_AHEAD=0 (or false, off, no) reads and builds on one thread, as before
(a measurement's other arm).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

Item = TypeVar("Item")
Read = TypeVar("Read")
Built = TypeVar("Built")

_OFF = ("0", "false", "off", "no")


def read_ahead_enabled() -> bool:
    return os.environ.get("KESTREL_LOAD_READ_AHEAD", "1").strip().lower() not in _OFF


def read_ahead(
    items: Sequence[Item],
    read: Callable[[Item], Read],
    build: Callable[[Item, Read], Built],
    *,
    waited: Callable[[float], None] | None = None,
) -> list[Built]:
    """[build(item, read(item)) for item in items], in order, with read(items[i + 1]) running
    on a worker thread while build(items[i], ...) runs on this one. `read` must not use what
    `build` changes (the two run at once); the worker is done (ended or cancelled) when this
    returns or raises, so the caller may use what `read` used after. An error stops the
    reads and is raised here: the one of the earliest item, build(i)'s before read(i + 1)'s.
    A read that runs out of GPU memory while the item before it is built is read again on
    this thread once that build is done and its read's tensors are let go. `waited(s)`
    hears, for each item, the seconds this thread spent before it could build it: waiting
    for the worker's read, or (read-ahead off, or one item) reading it itself."""
    results: list[Built] = []
    if len(items) < 2 or not read_ahead_enabled():
        for item in items:
            started = time.perf_counter()
            data = read(item)
            if waited is not None:
                waited(time.perf_counter() - started)
            results.append(build(item, data))
        return results
    device, stream = _current_cuda_stream()
    with ThreadPoolExecutor(
        1,
        thread_name_prefix="kestrel-read-ahead",
        initializer=_use_stream,
        initargs=(device, stream),
    ) as worker:
        pending: Future[Read] = worker.submit(read, items[0])
        try:
            for i, item in enumerate(items):
                started = time.perf_counter()
                try:
                    data = pending.result()
                except torch.cuda.OutOfMemoryError:
                    if i == 0:
                        raise  # nothing of this load's was in memory beside it
                    torch.cuda.empty_cache()
                    data = read(item)
                if waited is not None:
                    waited(time.perf_counter() - started)
                if i + 1 < len(items):
                    pending = worker.submit(read, items[i + 1])
                results.append(build(item, data))
                del data  # what was read goes as soon as it is built, not after the next read
        except BaseException:
            pending.cancel()  # not started: dropped; running: the pool's exit waits for it
            raise
    return results


def _current_cuda_stream() -> tuple[int | None, torch.cuda.Stream | None]:
    """This thread's CUDA device and stream, where CUDA is in use: a new thread starts on
    device 0's default stream, and a rank on cuda:1 would otherwise make a context on GPU 0
    (pinned buffers, events) and queue its copies apart from the builds."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device(), torch.cuda.current_stream()
    return None, None


def _use_stream(device: int | None, stream: torch.cuda.Stream | None) -> None:
    if device is not None:
        torch.cuda.set_device(device)
    if stream is not None:
        torch.cuda.set_stream(stream)
