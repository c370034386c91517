"""Positioned reads of weight-file bytes, spread over a few threads and, for a GPU, landed
in reused pinned host buffers copied over asynchronously (issue 33).

A tensor-parallel rank reads parts of the stored tensors (engine/tensor_parallel/cut_load.py).
It used to pread each part into a freshly allocated, pageable host tensor on one thread, gather
narrow column runs on the CPU, and copy the result to its GPU with a synchronous pageable
copy: each of the two ranks of a 70B load read at about 1.2 GB/s where one GPU's load reaches
~5 GB/s. Fresh host memory is faulted in page by page inside every read, the CPU gather is a
second pass over every byte, and nothing overlapped. Here:

- the bytes for a GPU go through a few pinned buffers allocated once per load (no page faults,
  no pageable copy); each buffer's copy runs on the GPU while the next one is read, and a buffer
  is reused once its copy's event has completed;
- one buffer's spans are read by several threads (os.preadv lets go of the GIL), each into its
  own bytes of the buffer;
- columns in narrow runs are cut on the GPU: whole rows are copied over and gathered there.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK_BYTES = 64 << 20  # one staging buffer
BUFFERS = 3  # in flight: one being read while the others' copies run
THREADS = 4  # reads per buffer at once (a host runs a rank per GPU)
_MIN_THREAD_BYTES = 4 << 20  # less than this a thread: one thread reads it all
MAX_GAP = 16 << 10  # bytes skipped within a read call: copying them costs about a call
MAX_CALL_BYTES = 64 << 20  # bytes of the file one read call spans at most
IOV_MAX = 1024  # buffers one preadv takes at most (IOV_MAX on Linux and macOS)

Span = tuple[int, int]  # (offset in the file, bytes)


def read_spans(fd: int, out: memoryview, spans: list[Span]) -> tuple[int, int]:
    """Each span, in order, into consecutive bytes of `out`; returns (bytes brought in from
    the file, read calls). Spans at most MAX_GAP apart share one preadv call, the bytes between
    them landing in a scratch buffer: a rank's q/k/v columns are one run a row, and a read per
    row made about 3,500 calls a layer for a 70B (the gaps are smaller than the kernel's
    read-ahead, so the disk reads them anyway)."""
    scratch: memoryview | None = None
    file_bytes = calls = 0
    at, i = 0, 0
    while i < len(spans):
        start, size = spans[i]
        vectors, end = [out[at : at + size]], start + size
        at, i = at + size, i + 1
        while i < len(spans) and len(vectors) < IOV_MAX - 1:
            offset, size = spans[i]
            gap = offset - end
            if not 0 <= gap <= MAX_GAP or offset + size - start > MAX_CALL_BYTES:
                break
            if gap:
                scratch = scratch if scratch is not None else memoryview(bytearray(MAX_GAP))
                vectors.append(scratch[:gap])
            vectors.append(out[at : at + size])
            at, end, i = at + size, offset + size, i + 1
        read_vectors(fd, vectors, start)
        file_bytes += end - start
        calls += 1
    return file_bytes, calls


def read_vectors(fd: int, vectors: list[memoryview], offset: int) -> None:
    """Fill `vectors` in order from the file's bytes at `offset`; a short read goes on where
    it stopped, and a file that ends early is an error."""
    first = 0
    while first < len(vectors):
        got = os.preadv(fd, vectors[first:] if first else vectors, offset)
        if got == 0:
            left = sum(len(v) for v in vectors[first:])
            raise OSError(f"the file ends before byte {offset + left}")
        offset += got
        while first < len(vectors) and got >= len(vectors[first]):
            got -= len(vectors[first])
            first += 1
        if got:
            vectors[first] = vectors[first][got:]


def split_spans(spans: list[Span], limit: int) -> list[list[Span]]:
    """`spans` cut into consecutive groups of at most `limit` bytes each (a span larger than
    that is cut too): their bytes, in order, are the spans' bytes."""
    groups: list[list[Span]] = [[]]
    room = limit
    for offset, size in spans:
        while size:
            if room == 0:
                groups.append([])
                room = limit
            take = min(size, room)
            groups[-1].append((offset, take))
            offset, size, room = offset + take, size - take, room - take
    return [g for g in groups if g]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (a view)."""
    return tensor.view(-1).view(torch.uint8)


class StagedReader:
    """Reads spans of weight files into host or GPU tensors (one per WeightStore, used by
    one thread at a time). Counts what it does: `file_bytes` and `read_calls` brought in,
    `buffer_allocations` (the staging buffers: allocated once per load, then reused),
    `wait_seconds` spent waiting for a buffer's copy to the GPU to end before reusing it."""

    def __init__(
        self,
        chunk_bytes: int = CHUNK_BYTES,
        buffers: int = BUFFERS,
        threads: int = THREADS,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.file_bytes = 0
        self.read_calls = 0
        self.buffer_allocations = 0
        self.wait_seconds = 0.0
        self._count = buffers
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._next = 0
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None

    # --- buffers -------------------------------------------------------------------------

    def _take(self, nbytes: int, pinned: bool) -> tuple[int, torch.Tensor]:
        """The next staging buffer (at least `nbytes`), once its last copy has completed."""
        i = self._next
        self._next = (i + 1) % self._count
        if i < len(self._buffers):
            event = self._events[i]
            if event is not None:
                started = time.perf_counter()
                event.synchronize()
                self.wait_seconds += time.perf_counter() - started
                self._events[i] = None
            if self._buffers[i].numel() >= nbytes and (self._buffers[i].is_pinned() or not pinned):
                return i, self._buffers[i]
        size = max(nbytes, self.chunk_bytes)
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        self.buffer_allocations += 1
        if i < len(self._buffers):
            self._buffers[i] = buffer
        else:
            self._buffers.append(buffer)
            self._events.append(None)
        return i, buffer

    def _copied(self, i: int, device: torch.device) -> None:
        """Buffer `i`'s copy to `device` is queued: reuse it only once that copy is done."""
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events[i] = event

    # --- reads ---------------------------------------------------------------------------

    def _read(self, fd: int, out: torch.Tensor, spans: list[Span]) -> None:
        """`spans` into host bytes `out` (uint8), several threads each taking a share."""
        total = sum(size for _, size in spans)
        shares = min(self._threads, max(1, total // _MIN_THREAD_BYTES))
        view = out.numpy().data
        if shares <= 1:
            counts = [read_spans(fd, view, spans)]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kestrel-read")
            groups = split_spans(spans, -(-total // shares))
            starts = [0]
            for g in groups[:-1]:
                starts.append(starts[-1] + sum(size for _, size in g))
            futures = [
                self._pool.submit(read_spans, fd, view[at:], g)
                for at, g in zip(starts, groups, strict=True)
            ]
            counts = [f.result() for f in futures]
        self.file_bytes += sum(c[0] for c in counts)
        self.read_calls += sum(c[1] for c in counts)

    def read_into(self, fd: int, result: torch.Tensor, spans: list[Span]) -> None:
        """The spans, in order, into the bytes of contiguous `result` (host or GPU)."""
        target = _bytes_of(result)
        if result.device.type == "cpu":  # straight into the result: no copy after
            self._read(fd, target, spans)
            return
        at = 0
        for group in split_spans(spans, self.chunk_bytes):
            n = sum(size for _, size in group)
            i, buffer = self._take(n, pinned=True)
            self._read(fd, buffer[:n], group)
            target[at : at + n].copy_(buffer[:n], non_blocking=True)
            self._copied(i, result.device)
            at += n

    def gather_columns(
        self, fd: int, offset: int, result: torch.Tensor, columns: torch.Tensor, cols: int
    ) -> None:
        """Columns `columns` of the stored [rows, cols] tensor at byte `offset` into `result`
        [rows, len(columns)]: whole rows read in blocks into a staging buffer and gathered
        where `result` lives (on a GPU, the rows are copied over and gathered there)."""
        rows = result.shape[0]
        row_bytes = cols * result.element_size()
        block = max(1, self.chunk_bytes // row_bytes)
        device = result.device
        on_host = device.type == "cpu"
        index = columns.to(device)
        landing = None if on_host else torch.empty((min(block, rows), cols), dtype=result.dtype,
                                                   device=device)  # fmt: skip
        for r in range(0, rows, block):
            n = min(block, rows - r)
            i, buffer = self._take(n * row_bytes, pinned=not on_host)
            self._read(fd, buffer[: n * row_bytes], [(offset + r * row_bytes, n * row_bytes)])
            whole = buffer[: n * row_bytes].view(result.dtype).view(n, cols)
            if landing is not None:
                landing[:n].copy_(whole, non_blocking=True)
                self._copied(i, device)
                whole = landing[:n]
            torch.index_select(whole, 1, index, out=result[r : r + n])

    def close(self) -> None:
        """Let go of the buffers (after their copies) and the threads."""
        for event in self._events:
            if event is not None:
                event.synchronize()
        self._buffers.clear()
        self._events.clear()
        self._next = 0
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
