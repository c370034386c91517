"""engine/read_ahead.py: the next item is read while the current one is built, results come
in order, and an error on either side stops the reads and reaches the caller."""

from __future__ import annotations

import threading

import pytest

from engine.read_ahead import read_ahead

# Bounds a wait that only a broken read-ahead would reach (the test then fails, not hangs).
WAIT_S = 60.0


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

    assert read_ahead([0, 1, 2], read, build) == [0, 1, 2]
    me = threading.current_thread().name
    assert order == [(step, i, me) for i in range(3) for step in ("read", "build")]
