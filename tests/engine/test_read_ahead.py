"""engine/read_ahead.py: the next item is read while the current one is built, results come
in order, an error on either side stops the reads and reaches the caller, a read that ran
out of GPU memory is read again, and a load gives the same model with it as without."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import engine.read_ahead as read_ahead_module
from engine.loading import load_causal_lm
from engine.read_ahead import read_ahead
from tools.bench import build_model

# Bounds a wait that only a broken read-ahead would reach (the test then fails, not hangs).
WAIT_S = 60.0


@pytest.fixture(autouse=True)
def _read_ahead_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """On, whatever the environment running the suite says (one test turns it off)."""
    monkeypatch.setenv("KESTREL_LOAD_READ_AHEAD", "1")


def test_results_come_in_order_built_from_their_own_reads() -> None:
    items = list(range(7))
    built = read_ahead(items, lambda i: i * 10, lambda i, data: (i, data))
    assert built == [(i, i * 10) for i in items]


def test_the_next_read_runs_while_the_current_item_is_built() -> None:
    """Building item i waits until read(i + 1) has started on the other thread: that only
    returns if the two run at once."""
    items = list(range(4))
    started = [threading.Event() for _ in items]
    threads: dict[str, set[str]] = {"read": set(), "build": set()}

    def read(i: int) -> int:
        threads["read"].add(threading.current_thread().name)
        started[i].set()
        return i

    def build(i: int, data: int) -> int:
        threads["build"].add(threading.current_thread().name)
        if i + 1 < len(items):
            assert started[i + 1].wait(WAIT_S), f"read({i + 1}) did not run during build({i})"
        return data

    assert read_ahead(items, read, build) == items
    assert threads["build"] == {threading.current_thread().name}
    assert threads["read"] and threads["read"].isdisjoint(threads["build"])


def test_a_failed_build_stops_the_reads_and_is_raised() -> None:
    read_items: list[int] = []

    def build(i: int, data: int) -> int:
        if i == 2:
            raise ValueError("tensor 'layers.2.qweight' is bad")
        return data

    def read(i: int) -> int:
        read_items.append(i)
        return i

    with pytest.raises(ValueError, match="layers.2.qweight"):
        read_ahead(list(range(10)), read, build)
    # Item 3 was being read (or queued) while item 2 failed; nothing later was started,
    # and the worker is done by the time the error arrives.
    snapshot = list(read_items)
    assert snapshot in ([0, 1, 2], [0, 1, 2, 3])
    assert not [t for t in threading.enumerate() if t.name.startswith("kestrel-read-ahead")]


def test_a_failed_read_is_raised_after_the_items_before_it_are_built() -> None:
    built: list[int] = []

    def read(i: int) -> int:
        if i == 3:
            raise OSError("the file ends before byte 4096")
        return i

    def build(i: int, data: int) -> int:
        built.append(i)
        return data

    with pytest.raises(OSError, match="byte 4096"):
        read_ahead(list(range(6)), read, build)
    assert built == [0, 1, 2]


def test_turned_off_it_reads_and_builds_on_this_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_LOAD_READ_AHEAD", "0")
    order: list[tuple[str, int, str]] = []

    def read(i: int) -> int:
        order.append(("read", i, threading.current_thread().name))
        return i

    def build(i: int, data: int) -> int:
        order.append(("build", i, threading.current_thread().name))
        return data

    waits: list[float] = []
    assert read_ahead([0, 1, 2], read, build, waited=waits.append) == [0, 1, 2]
    me = threading.current_thread().name
    assert order == [(step, i, me) for i in range(3) for step in ("read", "build")]
    assert len(waits) == 3  # the reads made on this thread are what it waited for


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_the_ways_to_turn_it_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KESTREL_LOAD_READ_AHEAD", value)
    assert not read_ahead_module.read_ahead_enabled()


def test_the_worker_takes_the_callers_device_and_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank on cuda:1 must not read on GPU 0 (a second CUDA context) or on another stream
    than its builds: the worker starts on what the caller's thread uses."""
    stream = object()
    monkeypatch.setattr(read_ahead_module, "_current_cuda_stream", lambda: (1, stream))
    set_on: dict[str, tuple[object, str]] = {}
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda d: set_on.update(device=(d, threading.current_thread().name)),
    )
    monkeypatch.setattr(
        torch.cuda,
        "set_stream",
        lambda s: set_on.update(stream=(s, threading.current_thread().name)),
    )
    readers: set[str] = set()

    def read(i: int) -> int:
        readers.add(threading.current_thread().name)
        return i

    assert read_ahead([0, 1, 2], read, lambda i, d: d) == [0, 1, 2]
    assert set_on["device"][0] == 1 and set_on["stream"][0] is stream
    assert {set_on["device"][1], set_on["stream"][1]} == readers
    assert threading.current_thread().name not in readers


def test_a_read_out_of_gpu_memory_is_read_again_after_the_build_before_it() -> None:
    """While item 2 is read ahead, item 1's build holds memory: the read that ran out is done
    again on the caller's thread once that build has finished."""
    attempts: list[tuple[int, str]] = []
    built: list[int] = []

    def read(i: int) -> int:
        attempts.append((i, threading.current_thread().name))
        if i == 2 and len(attempts) == 3:  # only the first try, the one made ahead
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return i * 10

    def build(i: int, data: int) -> int:
        built.append(i)
        return data

    me = threading.current_thread().name
    assert read_ahead([0, 1, 2, 3], read, build) == [0, 10, 20, 30]
    retries = [name for i, name in attempts if i == 2]
    assert len(retries) == 2 and retries[0] != me and retries[1] == me
    assert built == [0, 1, 2, 3]


def test_a_first_read_out_of_gpu_memory_is_raised() -> None:
    def read(i: int) -> int:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        read_ahead([0, 1], read, lambda i, d: d)


def test_waited_hears_one_wait_per_item() -> None:
    waits: list[float] = []
    read_ahead(list(range(5)), lambda i: i, lambda i, d: d, waited=waits.append)
    assert len(waits) == 5 and all(w >= 0.0 for w in waits)


@pytest.fixture(scope="module")
def tiny_gptq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("read-ahead") / "tiny-gptq", "tiny", "gptq", "cpu")


def _tensors(obj: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a loaded model holds: parameters, buffers and the quantized weights'
    dataclasses (planes, scales, zeros, permutations), by path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, torch.nn.Module):
        for name, t in obj.named_parameters(recurse=False):
            yield f"{prefix}.{name}", t
        for name, t in obj.named_buffers(recurse=False):
            yield f"{prefix}.{name}", t
        for name, value in vars(obj).items():
            if dataclasses.is_dataclass(value):
                yield from _tensors(value, f"{prefix}.{name}")
        for name, child in obj.named_children():
            yield from _tensors(child, f"{prefix}.{name}")
    elif dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, field.name), f"{prefix}.{field.name}")
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}[{i}]")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_load_gives_the_same_model_with_and_without_it(
    tiny_gptq: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """On a GPU the pieces are read to the host ahead and repacked there by the load's
    thread, on the stream the worker was given."""
    where = torch.device(device)
    ahead = dict(_tensors(load_causal_lm(tiny_gptq, device=where, dtype=torch.float16)))
    monkeypatch.setenv("KESTREL_LOAD_READ_AHEAD", "0")
    plain = dict(_tensors(load_causal_lm(tiny_gptq, device=where, dtype=torch.float16)))
    assert ahead.keys() == plain.keys()
    planes = [k for k in ahead if ".packed" in k]
    assert planes, "no quantized weight reached: the comparison would be vacuous"
    for name in ahead:
        if ".packed" in name:
            assert ahead[name].device.type == device, name
        assert torch.equal(ahead[name], plain[name]), name


@pytest.mark.parametrize("ahead", ["1", "0"])
def test_a_ranks_load_phases_count_the_workers_reads_once(
    tiny_gptq: Path, monkeypatch: pytest.MonkeyPatch, ahead: str
) -> None:
    """A TP rank's read-and-cut remainder is its wall time less what its own thread did: the
    worker's reads run beside the repacks and count as the time waited for them, so the
    remainder cannot go below zero (it read -3.2 s on 2x H200 when they were added twice)."""
    from engine.tensor_parallel.load_phases import LoadPhases
    from engine.tensor_parallel.rank import ShardSpec, load_rank

    spec = ShardSpec(
        model_dir=str(tiny_gptq), world_size=2, device_type="cpu", dtype="float32",
        cache_type="fp16", max_seq_len=64, cache_pages=4, page_size=16, rope_alpha=1.0,
        cuda_graphs=False, init_method="unused://",  # load_rank joins no group
    )  # fmt: skip
    monkeypatch.setenv("KESTREL_LOAD_READ_AHEAD", ahead)
    phases = LoadPhases()
    load_rank(spec, 1, phases)
    counts = phases.counts
    assert counts["ahead_s"] > 0.0, "the rank's quantized reads were not counted as read_ahead's"
    assert counts["ahead_s"] <= counts["read_s"] + counts["place_s"] + 0.002
    assert counts["ahead_wait_s"] >= 0.0
    assert counts["read_cut_other_s"] >= -0.005  # the counts are rounded to the millisecond
