"""WeightStore.get_part: runs of rows or columns read straight from a safetensors file equal
the same runs cut from the whole tensor, for every stored dtype the loaders cut, and a file
cut short names itself instead of returning garbage."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import weights
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


def test_gathered_columns_across_blocks_of_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks of 5 rows of the 16: three whole blocks and one of a single row.
    monkeypatch.setattr(weights, "_BLOCK_BYTES", 5 * 24 * 4)
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    store = WeightStore(tmp_path)
    try:
        part = store.get_part("a.int32", 1, RUNS)
        assert torch.equal(part, _cut(tensors["a.int32"], 1, RUNS))
    finally:
        store.close()
