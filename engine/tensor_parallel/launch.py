"""Rank 0 of a tensor-parallel model: the launcher.

`launch_tensor_parallel(model_dir, options, world_size)` spawns ranks 1..W-1 (one process
per GPU, first thing, so that their start-up overlaps rank 0's; or takes those the caller
prestarted: spawned.py) or, under torchrun, takes the ranks torchrun started
(those run `serve_launched_rank`: engine/tensor_parallel/launched.py; they load with the
spec rank 0 resolved, sent through torchrun's store: shared_spec.py). Every rank loads
its own shard (only its parts of the checkpoint: cut_load.py) before they join one process
group (NCCL on GPUs, gloo on the CPU): rank 0 reads while the ranks it spawned still
start, and joins once each has said it loaded, so a rank that failed is never waited for.
Then the all-reduces are set up on every rank. It returns an ordinary `Engine`
(tokenizer, scheduler, page bookkeeping) whose runner is a `TensorParallelRunner`
(engine/tensor_parallel/runner.py): the runner owns the other ranks, broadcasts each step
to them (they run the same forward on their shards) and stops them when the engine
unloads. Decode steps replay CUDA graphs on every rank (all-reduces captured inside);
prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import functools
import os
import queue
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from engine.architectures.base import CausalLM
from engine.cache import PagedKVCache
from engine.config import ModelConfig
from engine.engine import CACHE_TYPES, DEFAULT_MAX_SEQ_LEN, Engine, EngineOptions
from engine.loading import overflows_float16, resolve_device, resolve_dtype
from engine.tensor_parallel.all_reduce import preimport_symmetric_memory
from engine.tensor_parallel.errors import TensorParallelError
from engine.tensor_parallel.launched import LaunchedRank, launched_rank
from engine.tensor_parallel.leave import ServingRank, abandon_group, leave_group
from engine.tensor_parallel.load_phases import LoadPhases
from engine.tensor_parallel.protocol import Channel
from engine.tensor_parallel.rank import (
    NCCL_ENV,
    ShardSpec,
    exchange_rank_reports,
    finish_rank,
    finish_serving_rank,
    init_rank,
    load_rank,
    rank_memory,
    serve,
)
from engine.tensor_parallel.ranks import Ranks
from engine.tensor_parallel.runner import TensorParallelRunner
from engine.tensor_parallel.shared_spec import publish_spec, receive_spec, rendezvous_store
from engine.tensor_parallel.spawned import SpawnedRanks, discard_prestarted, take_ranks
from engine.tokenizer import Tokenizer

READY_TIMEOUT_S = 3600.0  # a 70B shard reads ~40 GB from disk


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def launch_tensor_parallel(
    model_dir: str | Path, options: EngineOptions | None, world_size: int
) -> Engine:
    """Rank 0 of `world_size` ranks: spawned here (one process per GPU of this machine),
    or, in a torchrun launch (engine/tensor_parallel/launched.py), the ranks torchrun
    started, joined through torch.distributed's environment rendezvous."""
    options = options or EngineOptions()
    started = time.perf_counter()
    phases = LoadPhases()
    model_dir = Path(model_dir)
    launched = launched_rank()
    if launched is not None:
        discard_prestarted()  # torchrun started the ranks
        if launched.rank != 0:
            raise TensorParallelError(
                f"this is rank {launched.rank} of a torchrun launch: ranks other than 0 "
                "run serve_launched_rank, not the engine"
            )
        if world_size != launched.world_size:
            raise TensorParallelError(
                f"tp={world_size} asked for, but torchrun started {launched.world_size} "
                "ranks (WORLD_SIZE)"
            )
    try:
        _refuse_options(options, world_size)
    except BaseException:
        discard_prestarted()  # ranks the caller started for this launch
        raise
    os.environ.update(NCCL_ENV)  # inherited by ranks spawned now, set before NCCL init
    spawned: SpawnedRanks | None = None
    if launched is None:
        # First of all (before the config, the tokenizer and the weights): a new rank takes
        # seconds to start and import torch and the engine, and everything rank 0 does
        # before its own reads is time the ranks' start-up can hide behind. Ranks
        # prestarted by the caller (spawned.prestart) are taken as they are.
        with phases.phase("spawn ranks"):
            spawned = take_ranks(world_size)
    store: Store | None = None
    with phases.phase("shard spec"):
        try:
            if launched is not None:
                store = rendezvous_store(READY_TIMEOUT_S)
            spec, config, max_seq_len = _shard_spec(
                model_dir, options, world_size, launched, phases.origin
            )
        except BaseException as e:
            if spawned is not None:
                spawned.stop()  # waiting for a spec that never comes: end them now
            if store is not None:  # torchrun's other ranks wait for the spec: say why not
                publish_spec(store, None, f"{type(e).__name__}: {e}")
            raise
    if store is not None:
        publish_spec(store, spec)  # the ranks torchrun started load with exactly this
    workers: list[BaseProcess] = spawned.processes if spawned is not None else []
    reports: Queue[tuple[int, str | None]] | None = spawned.reports if spawned else None
    try:
        if spawned is not None:
            spawned.send_spec(spec)
        tokenizers: list[Tokenizer] = []

        def load_tokenizer() -> None:
            with phases.phase("tokenizer"):
                tokenizers.append(Tokenizer.from_dir(model_dir))

        if launched is not None:
            # Before the load: a failure after it would leave torchrun's other ranks waiting
            # in the rendezvous, and they would not know why.
            load_tokenizer()
        # Every rank loads its shard before joining the group: this one reads while the
        # ranks it spawned still start up and import, and loads the tokenizer (a fifth of a
        # second) once it waits for them, not before its reads.
        model, cache, channel = _load_then_join(
            spec, 0, phases, workers, reports, store, load_tokenizer if launched is None else None
        )
        tokenizer = tokenizers[0]
        graphs = finish_rank(model, cache, spec, 0, phases)
        with phases.phase("exchange reports"):
            memory, load_phases = exchange_rank_reports(
                rank_memory(model, cache, spec.device(0)), phases
            )
    except BaseException:
        if spawned is not None:
            spawned.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    options = EngineOptions(**{**options.__dict__, "max_seq_len": max_seq_len})
    ranks = Ranks(
        world_size=world_size,
        device=spec.device(0),
        devices=[str(spec.device(rank)) for rank in range(world_size)],
        channel=channel,
        workers=workers,
        reports=reports if launched is None else None,
        launched=launched is not None,
        memory=memory,
        load_phases=load_phases,
    )
    engine_started = time.time()
    engine = Engine(
        config,
        model,
        cache,
        tokenizer,
        options,
        model_dir,
        time.perf_counter() - started,
        runner_factory=functools.partial(TensorParallelRunner, ranks=ranks),
    )
    engine.runner.graphs = graphs
    phases.add("engine", engine_started, time.time())
    load_phases[0] = phases.report()
    return engine


def _refuse_options(options: EngineOptions, world_size: int) -> None:
    """What no tensor-parallel launch can do, known before any rank is started."""
    if world_size < 2:
        raise TensorParallelError(f"tensor parallelism needs 2 or more ranks, got {world_size}")
    if options.gpu_split or options.autosplit or options.cpu_offload:
        raise TensorParallelError(
            "tensor parallelism and layer split (gpu_split/autosplit/cpu_offload) "
            "cannot be combined"
        )
    if dist.is_initialized():
        raise TensorParallelError(
            "a tensor-parallel model is already loaded in this process; unload it first"
        )
    if options.cache_type not in CACHE_TYPES:
        raise ValueError(
            f"cache_type '{options.cache_type}' is not supported yet "
            f"(available: {', '.join(CACHE_TYPES)})"
        )


def _shard_spec(
    model_dir: Path,
    options: EngineOptions,
    world_size: int,
    launched: LaunchedRank | None,
    started_at: float,
) -> tuple[ShardSpec, ModelConfig, int]:
    """What every rank builds its shard from, checked. Only rank 0 computes it; under
    torchrun the other ranks receive it (shared_spec.py says why)."""
    config = ModelConfig.from_dir(model_dir)
    if config.num_key_value_heads % world_size or config.num_attention_heads % world_size:
        raise TensorParallelError(
            f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads do "
            f"not divide among {world_size} ranks"
        )
    device = resolve_device(options.device)
    local_ranks = launched.local_world_size if launched is not None else world_size
    if device.type == "cuda" and torch.cuda.device_count() < local_ranks:
        raise TensorParallelError(
            f"tensor parallelism over {local_ranks} GPUs of this machine asked for, "
            f"{torch.cuda.device_count()} are visible"
        )
    dtype = resolve_dtype(
        options.dtype, device, overflows_float16=overflows_float16(config.architecture)
    )
    max_seq_len = options.max_seq_len or min(config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    cache_tokens = options.cache_tokens or max_seq_len
    spec = ShardSpec(
        model_dir=str(model_dir),
        world_size=world_size,
        device_type=device.type,
        dtype=str(dtype).removeprefix("torch."),
        cache_type=options.cache_type,
        max_seq_len=max_seq_len,
        cache_pages=-(-cache_tokens // options.page_size),
        page_size=options.page_size,
        rope_alpha=options.rope_alpha,
        rope_scale=options.rope_scale,
        cuda_graphs=options.cuda_graphs and device.type == "cuda",
        # torchrun's rendezvous (MASTER_ADDR/MASTER_PORT) or a port of this machine.
        init_method="env://" if launched is not None else f"tcp://127.0.0.1:{_free_port()}",
        local_world_size=launched.local_world_size if launched is not None else None,
        started_at=started_at,
    )
    return spec, config, max_seq_len


def serve_launched_rank(model_dir: str | Path) -> None:
    """A rank other than 0 of a torchrun launch: build this rank's shard of `model_dir` (this
    machine's copy of rank 0's model) with the spec rank 0 resolved from its options, then
    run what rank 0 announces until it unloads the model."""
    launched = launched_rank()
    if launched is None or launched.rank == 0:
        raise TensorParallelError(
            "serve_launched_rank runs in ranks 1.. of a torchrun launch (RANK, WORLD_SIZE, "
            "LOCAL_RANK, MASTER_ADDR and MASTER_PORT set); rank 0 loads the engine"
        )
    phases = LoadPhases()
    with phases.phase("shard spec"):
        store = rendezvous_store(READY_TIMEOUT_S)
        spec = receive_spec(store, launched, Path(model_dir), phases.origin, READY_TIMEOUT_S)
    os.environ.update(NCCL_ENV)
    serving: ServingRank | None = None
    try:
        model, cache, channel = _load_then_join(spec, launched.rank, phases, [], None, store)
        serving = ServingRank(model, cache)
        del model, cache  # held by `serving` alone: leaving lets go of all of it
        finish_serving_rank(serving, spec, launched.rank, phases)
        # Ctrl+C reaches every process of the terminal's group, and torchrun passes its
        # SIGINT/SIGTERM on to its ranks: rank 0 answers by unloading, which stops this rank
        # through the serving loop. Dying here first would leave rank 0's stop unanswered.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        serve(serving, channel, spec.max_seq_len)
    except BaseException:
        if serving is not None:
            serving.release()
        if dist.is_initialized():  # not when joining the group itself failed
            abandon_group()
        raise
    leave_group(channel, serving.release())  # with rank 0's unload (leave.py)


def _load_then_join(
    spec: ShardSpec,
    rank: int,
    phases: LoadPhases,
    workers: list[BaseProcess],
    reports: Queue[tuple[int, str | None]] | None,
    store: Store | None = None,
    while_waiting: Callable[[], None] | None = None,
) -> tuple[CausalLM, PagedKVCache, Channel]:
    """This rank's shard and cache, then the group, once every rank has loaded: spawned
    ranks say so on `reports` before they join (one that failed never joins, and rank 0
    must not wait for it in the rendezvous); torchrun's ranks all join and exchange their
    outcome, so that all of them raise if one failed. `while_waiting`: rank 0's own work
    that can wait until its shard is read (spawned ranks only), done before it waits."""
    if reports is not None:
        model, cache, _ = load_rank(spec, rank, phases)
        # While this rank waits for the others (all_reduce.py says why not during the reads).
        preimport_symmetric_memory(spec.device(rank))
        if while_waiting is not None:
            while_waiting()
        with phases.phase("wait for ranks"):
            _wait_ready(workers, reports)
        with phases.phase("join group"):
            return model, cache, init_rank(spec, rank)
    error = None
    try:
        model, cache, _ = load_rank(spec, rank, phases)
    except Exception as e:
        error = e
    preimport_symmetric_memory(spec.device(rank))  # beside the rendezvous's wait
    with phases.phase("join group"):
        channel = init_rank(spec, rank, store)
    with phases.phase("wait for ranks"):
        failed = _gather_load_errors(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed:
        other, text = failed[0]
        raise TensorParallelError(f"tensor-parallel rank {other} failed to load: {text}")
    return model, cache, channel


def _gather_load_errors(error: str | None) -> list[tuple[int, str]]:
    """Every rank's load outcome (None: ready), so that all ranks agree whether to go on."""
    outcomes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, error)
    return [(rank, e) for rank, e in enumerate(outcomes) if e is not None]


def _wait_ready(workers: list[BaseProcess], reports: Queue[tuple[int, str | None]]) -> None:
    """Wait until every spawned rank has built its shard; raise with a rank's error."""
    pending = {rank for rank in range(1, len(workers) + 1)}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while pending:
        try:
            rank, error = reports.get(timeout=1.0)
        except queue.Empty:
            dead = [w for w in workers if not w.is_alive() and w.exitcode not in (None, 0)]
            if dead:
                raise TensorParallelError(
                    f"a tensor-parallel rank exited with code {dead[0].exitcode} while loading"
                ) from None
            if time.monotonic() > deadline:
                raise TensorParallelError("tensor-parallel ranks did not load in time") from None
            continue
        if error is not None:
            raise TensorParallelError(f"tensor-parallel rank {rank} failed to load: {error}")
        pending.discard(rank)
