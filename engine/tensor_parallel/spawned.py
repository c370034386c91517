"""Ranks 1.. of a tensor-parallel model that this machine spawns, and starting them early.

A spawned rank spends its first seconds starting Python and importing torch and the engine
(4 s of an 8B TP=2 load's 20 s on a 2xH100 host, issue 33) while rank 0 waits for it in the
process group's rendezvous. So the ranks start before anything else of the launch, and they
take their ShardSpec afterwards, through a pipe: `spawn_ranks` starts them and
`SpawnedRanks.send_spec` tells them what to build. A caller that knows early that it will
load with tensor parallelism (the CLI's --tp N) calls `prestart(world_size)` before it
imports torch itself, so that the ranks' imports and its own run at the same time;
launch_tensor_parallel then takes those ranks instead of starting new ones.

Nothing at module level here imports torch or the engine: a rank notes when it began, then
imports them (load_phases.py records both).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import TYPE_CHECKING

from engine.tensor_parallel.errors import TensorParallelError

if TYPE_CHECKING:
    from engine.tensor_parallel.rank import ShardSpec


@dataclass
class SpawnedRanks:
    """Ranks 1..world_size-1, started and waiting for their ShardSpec (or building it)."""

    world_size: int
    processes: list[BaseProcess]
    # Each rank writes (rank, None) once loaded, or (rank, error text).
    reports: Queue[tuple[int, str | None]]
    specs: list[Connection]  # where each rank's ShardSpec goes, by rank - 1
    spawned_at: float  # time.time() when they were started

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def send_spec(self, spec: ShardSpec) -> None:
        for rank, (conn, process) in enumerate(zip(self.specs, self.processes, strict=True), 1):
            try:
                conn.send(spec)
            except OSError:  # the rank is gone (its start-up or imports failed)
                process.join(timeout=5.0)
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} exited with code {process.exitcode} before "
                    f"it was given its shard{self._reported(rank)}"
                ) from None
            conn.close()
        self.specs = []

    def _reported(self, rank: int) -> str:
        """': <error>' when `rank` put its error on the reports queue, else ''."""
        try:
            while True:
                reported, error = self.reports.get(timeout=1.0)
                if reported == rank and error is not None:
                    return f": {error}"
        except (queue.Empty, OSError, ValueError):
            return ""

    def stop(self) -> None:
        """Terminate the ranks still alive (no collective: a rank may be stuck in one, or
        still waiting for its spec)."""
        for conn in self.specs:
            conn.close()
        self.specs = []
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=10.0)


_prestarted: SpawnedRanks | None = None


def prestart(world_size: int) -> None:
    """Start ranks 1..world_size-1 now, ahead of a tensor-parallel launch in this process
    (which takes them): call it before importing torch, so that they import at the same
    time as this process. Nothing is started for fewer than 2 ranks, or twice."""
    global _prestarted
    if world_size >= 2 and _prestarted is None:
        _prestarted = spawn_ranks(world_size)


def has_prestarted() -> bool:
    """Whether ranks started by `prestart` wait for a launch to take them."""
    return _prestarted is not None


def discard_prestarted() -> None:
    """Stop prestarted ranks that no launch took (the load failed or went another way)."""
    global _prestarted
    ranks, _prestarted = _prestarted, None
    if ranks is not None:
        ranks.stop()


def take_ranks(world_size: int) -> SpawnedRanks:
    """The prestarted ranks when they are `world_size`'s and all alive, else new ones."""
    global _prestarted
    ranks, _prestarted = _prestarted, None
    if ranks is not None and (ranks.world_size != world_size or not ranks.alive()):
        ranks.stop()
        ranks = None
    return ranks if ranks is not None else spawn_ranks(world_size)


def spawn_ranks(world_size: int) -> SpawnedRanks:
    """Start ranks 1..world_size-1 (daemons: they end with this process), each waiting for
    its ShardSpec."""
    context = mp.get_context("spawn")
    reports: Queue[tuple[int, str | None]] = context.Queue()
    spawned_at = time.time()
    processes: list[BaseProcess] = []
    specs: list[Connection] = []
    for rank in range(1, world_size):
        receive, send = context.Pipe(duplex=False)
        process = context.Process(
            target=rank_main, args=(rank, receive, reports, spawned_at), daemon=True
        )
        process.start()
        receive.close()  # the rank has its own copy; its reads see EOF once `send` closes
        processes.append(process)
        specs.append(send)
    return SpawnedRanks(world_size, processes, reports, specs, spawned_at)


def rank_main(
    rank: int,
    specs: Connection,
    reports: Queue[tuple[int, str | None]],
    spawned_at: float,
) -> None:
    """A spawned rank: import the engine, wait for the ShardSpec, then be the rank
    (rank.worker_main). Returns quietly when rank 0 closes the pipe without a spec."""
    entered = time.time()
    try:
        from engine.tensor_parallel.load_phases import LoadPhases
        from engine.tensor_parallel.rank import worker_main  # torch and the engine: long

    except Exception as e:  # a broken install: rank 0 says so instead of waiting
        reports.put((rank, f"importing the engine failed: {type(e).__name__}: {e}"))
        reports.close()
        reports.join_thread()
        raise
    imported = time.time()
    if not specs.poll():
        # Rank 0 has not sent the spec yet (it started this rank ahead of its own imports):
        # the symmetric-memory imports run now, while this rank waits, not later beside its
        # reads (all_reduce.py's preimport_symmetric_memory says why). On a CUDA build of
        # torch the ranks are GPUs' (a gloo run on such a machine imports them for nothing).
        _preimport_on_cuda_builds()
    try:
        spec = specs.recv()
    except EOFError:  # rank 0 stopped before sending it (its launch failed, or it exited)
        return
    finally:
        specs.close()
    phases = LoadPhases(origin=spec.started_at or spawned_at)
    phases.add("process start", spawned_at, entered)
    phases.add("import", entered, imported)
    phases.add("wait for spec", imported, time.time())
    worker_main(rank, spec, reports, phases)


def _preimport_on_cuda_builds() -> None:
    import torch

    from engine.tensor_parallel.all_reduce import preimport_symmetric_memory

    if torch.version.cuda is not None:
        preimport_symmetric_memory(torch.device("cuda"))
