"""engine/staged_reads.py: a tensor-parallel rank's part reads go through a few staging
buffers allocated once per load and reused (fresh host memory per tensor was faulted in page
by page inside every read, issue 33), and a buffer's spans are read by several threads, each
into its own bytes: the parts equal the cut of the whole tensor either way."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import staged_reads
from engine.staged_reads import StagedReader, split_spans
from engine.weights import WeightStore


def _cut(t: torch.Tensor, dim: int, runs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t.narrow(dim, a, b - a) for a, b in runs], dim)


def _store(tmp_path: Path) -> tuple[WeightStore, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    tensors = {
        f"layer{i}.qweight": torch.randint(
            -(2**31), 2**31 - 1, (40, 64), generator=gen, dtype=torch.int32
        )  # fmt: skip
        for i in range(6)
    }
    save_file(tensors, tmp_path / "model.safetensors")
    return WeightStore(tmp_path), tensors


def test_split_spans_keeps_every_byte_in_order() -> None:
    spans = [(0, 10), (100, 3), (200, 25)]
    groups = split_spans(spans, 8)
    assert all(sum(n for _, n in g) <= 8 for g in groups)
    flat = [b for g in groups for o, n in g for b in range(o, o + n)]
    assert flat == [b for o, n in spans for b in range(o, o + n)]


def test_staging_buffers_are_allocated_once_and_reused(tmp_path: Path) -> None:
    # Narrow column runs: whole rows land in a staging buffer (10 rows of 256 bytes a block)
    # and are gathered from it. Six tensors of four blocks each: still two buffers.
    store, tensors = _store(tmp_path)
    store.reader = StagedReader(chunk_bytes=10 * 64 * 4, buffers=2, threads=1)
    runs = [(a, a + 4) for a in range(0, 64, 8)]
    try:
        for name, whole in tensors.items():
            assert torch.equal(store.get_part(name, 1, runs), _cut(whole, 1, runs))
        assert store.reader.buffer_allocations == 2
        assert store.read_calls == 6 * 4  # one read a block of rows
    finally:
        store.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_threads_share_a_read_and_the_part_is_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    monkeypatch.setattr(staged_reads, "_MIN_THREAD_BYTES", 1)  # tiny tensors: split anyway
    monkeypatch.setattr(staged_reads, "MAX_GAP", 0)  # a read call per run
    store, tensors = _store(tmp_path)
    store.reader = StagedReader(threads=threads)
    rows = [(0, 7), (9, 30), (31, 40)]
    wide = [(3, 40)]
    try:
        for name, whole in tensors.items():
            assert torch.equal(store.get_part(name, 0, rows), _cut(whole, 0, rows))
            assert torch.equal(store.get_part(name, 1, wide), _cut(whole, 1, wide))
        # rows: one call a run; columns: one a row (no gap is read through)
        calls = 6 * (3 + 40)
        if threads > 1:  # a run cut between two threads is two calls
            assert calls < store.read_calls <= 6 * (3 + 2 + 40 + 2)
        else:
            assert store.read_calls == calls
    finally:
        store.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_parts_read_onto_a_gpu_through_pinned_buffers_equal_the_host_reads(
    tmp_path: Path,
) -> None:
    # Rows, one run a row, and narrow runs gathered on the GPU, through 2 pinned buffers of
    # 10 rows: more chunks than buffers, so buffers are reused while copies may still run.
    store, tensors = _store(tmp_path)
    store.reader = StagedReader(chunk_bytes=10 * 64 * 4, buffers=2, threads=2)
    gpu = torch.device("cuda", 0)
    cases = [
        (0, [(0, 7), (9, 30), (31, 40)]),
        (1, [(3, 40)]),
        (1, [(a, a + 4) for a in range(0, 64, 8)]),
    ]
    try:
        for name, whole in tensors.items():
            for dim, runs in cases:
                part = store.get_part(name, dim, runs, device=gpu)
                assert part.device == gpu
                assert torch.equal(part.cpu(), _cut(whole, dim, runs)), (name, dim, runs)
        assert store.reader.buffer_allocations == 2
        assert all(b.is_pinned() for b in store.reader._buffers)
    finally:
        store.close()
