"""WeightStore.get_part: runs of rows or columns read straight from a safetensors file equal
the same runs cut from the whole tensor, for every stored dtype the loaders cut, and a file
cut short names itself instead of returning garbage."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import staged_reads
from engine.staged_reads import StagedReader
from engine.weights import WeightError, WeightStore

RUNS = [(0, 3), (5, 6), (9, 16)]  # narrow: columns are gathered from whole rows
WIDE = [(2, 14)]  # one run: a read per row


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.int32": torch.randint(-(2**31), 2**31 - 1, (16, 24), generator=gen, dtype=torch.int32),
        "b.bf16": torch.randn(16, 24, generator=gen).to(torch.bfloat16),
        "c.fp16": torch.randn(24, 16, generator=gen).to(torch.float16),
        "d.bias": torch.randn(16, generator=gen),
    }


def _cut(t: torch.Tensor, dim: int, runs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t.narrow(dim, a, b - a) for a, b in runs], dim)


@pytest.mark.parametrize("runs", [RUNS, WIDE])
@pytest.mark.parametrize("dim", [0, 1])
def test_parts_equal_the_cut_of_the_whole_tensor(
    tmp_path: Path, dim: int, runs: list[tuple[int, int]]
) -> None:
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    store = WeightStore(tmp_path)
    try:
        for name, whole in tensors.items():
            if whole.dim() == 1 and dim == 1:
                continue
            part = store.get_part(name, dim, runs)
            assert part.dtype == whole.dtype and part.is_contiguous()
            assert torch.equal(part, _cut(whole, dim, runs)), name
        # one run covering everything is the tensor itself
        assert torch.equal(store.get_part("c.fp16", 1, [(0, 16)]), tensors["c.fp16"])
    finally:
        store.close()


def test_parts_count_only_their_bytes(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    store = WeightStore(tmp_path)
    try:
        store.get_part("b.bf16", 1, RUNS)
        assert store.bytes_read == 16 * sum(b - a for a, b in RUNS) * 2
    finally:
        store.close()


def test_a_file_cut_short_after_opening_names_the_file_and_tensor(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    store = WeightStore(tmp_path)  # the header was whole when the store read it
    try:
        size = path.stat().st_size
        with path.open("r+b") as f:  # then the file loses its last tensor's bytes
            f.truncate(size - 200)
        last = max(tensors, key=lambda n: store.info(n).offset)
        with pytest.raises(WeightError, match=rf"model\.safetensors: cannot read tensor '{last}'"):
            store.get_part(last, 0, [(0, store.info(last).shape[0])])
    finally:
        store.close()


def test_gathered_columns_across_blocks_of_rows(tmp_path: Path) -> None:
    # Blocks of 5 rows of the 16: three whole blocks and one of a single row.
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    store = WeightStore(tmp_path)
    store.reader = StagedReader(chunk_bytes=5 * 24 * 4)
    try:
        part = store.get_part("a.int32", 1, RUNS)
        assert torch.equal(part, _cut(tensors["a.int32"], 1, RUNS))
    finally:
        store.close()


def test_one_column_run_a_row_is_read_in_one_call(tmp_path: Path) -> None:
    # A TP rank's q/k/v columns: one run a row. A read per row made ~1,700 calls a layer (8B).
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    store = WeightStore(tmp_path)
    try:
        part = store.get_part("a.int32", 1, WIDE)
        assert torch.equal(part, _cut(tensors["a.int32"], 1, WIDE))
        assert store.read_calls == 1
        # from the first wanted byte to the last: the columns between rows come along
        assert store.file_bytes == (15 * 24 + 14 - 2) * 4
        assert store.bytes_read == 16 * 12 * 4
    finally:
        store.close()


@pytest.mark.parametrize(
    ("max_gap", "iov_max", "calls"), [(47, 1024, 16), (48, 5, 6), (48, 1024, 1)]
)
def test_spans_split_where_a_gap_is_too_wide_or_buffers_run_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_gap: int, iov_max: int, calls: int
) -> None:
    # Rows of 24 int32 (96 bytes) of which 12 are kept: 48 bytes between one row's run and
    # the next row's. A wider gap than MAX_GAP ends a call; so does the call's buffer limit
    # (at 5 buffers: a run, then a gap and a run twice, so 16 rows take 6 calls).
    monkeypatch.setattr(staged_reads, "MAX_GAP", max_gap)
    monkeypatch.setattr(staged_reads, "IOV_MAX", iov_max)
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    store = WeightStore(tmp_path)
    try:
        part = store.get_part("a.int32", 1, WIDE)
        assert torch.equal(part, _cut(tensors["a.int32"], 1, WIDE))
        assert store.read_calls == calls
    finally:
        store.close()
