"""One tensor-parallel rank: build its shard of the model and KV cache, and (ranks > 0)
serve the forwards rank 0 announces until told to stop.

Every rank reads only its part of each linear, of the embeddings and of the head
(cut_load.py: the shard transform.py would cut from the whole model), on its GPU as far as
the staging plan lets it and on the CPU past that (staging.py), wraps the parts into its
modules (transform.py) and moves them to its device: cuda:<rank> with NCCL, or the CPU with
gloo (what CI tests).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.queues import Queue

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store

from engine.architectures.base import CausalLM
from engine.cache import PagedKVCache
from engine.config import ModelConfig
from engine.cpu_threads import cpu_threads
from engine.cuda_graph import DecodeGraphs
from engine.held_bytes import held_bytes
from engine.loading import DTYPES, load_causal_lm
from engine.placement import Placement
from engine.placement.footprint import model_footprint
from engine.tensor_parallel import protocol
from engine.tensor_parallel.all_reduce import (
    GroupAllReduce,
    finish_symmetric_memory_imports,
    preimport_symmetric_memory,
)
from engine.tensor_parallel.cut_load import RankCuts
from engine.tensor_parallel.leave import ServingRank, leave_group
from engine.tensor_parallel.load_phases import LoadPhases
from engine.tensor_parallel.staging import staging_placement, staging_pool
from engine.tensor_parallel.transform import move_model, shard_model, use_all_reduce
from engine.weights import WeightStore

# NVLink SHARP multicast (NVLS) can take GPUs shared with others out of service; NCCL and
# torch's symmetric memory must not use it. Set before any NCCL communicator exists.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@dataclass(frozen=True)
class ShardSpec:
    """What every rank needs to build its shard (picklable: sent to spawned workers)."""

    model_dir: str
    world_size: int
    device_type: str  # "cuda" (rank r on cuda:r, NCCL) or "cpu" (gloo)
    dtype: str  # a key of engine.loading.DTYPES
    # K/V storage (kernels/kv_quant.py). Quantized types keep their codes and scales per
    # token and KV head, so a rank's cache of its own KV heads holds exactly what one
    # process's cache holds for them.
    cache_type: str
    max_seq_len: int
    cache_pages: int
    page_size: int
    rope_alpha: float
    cuda_graphs: bool
    init_method: str  # tcp://127.0.0.1:<port>
    timeout_s: float = 1800.0
    rope_scale: float = 1.0  # EngineOptions.rope_scale
    # Ranks per machine: rank r uses GPU r % local_world_size of its machine (torchrun over
    # several machines); None: every rank on this one, rank r on cuda:r.
    local_world_size: int | None = None
    # time.time() when rank 0 began the launch: the origin of the load phases of the ranks it
    # spawned (load_phases.py). Under torchrun each rank's own start.
    started_at: float = 0.0

    def device(self, rank: int) -> torch.device:
        if self.device_type != "cuda":
            return torch.device("cpu")
        return torch.device("cuda", rank % (self.local_world_size or self.world_size))

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"


def use_rank_device(spec: ShardSpec, rank: int) -> None:
    """Make this rank's GPU current (kernels launch on the current device) and set the NCCL
    environment, before anything touches the GPU or NCCL."""
    os.environ.update(NCCL_ENV)
    if spec.device_type == "cuda":
        torch.cuda.set_device(spec.device(rank))


def init_rank(spec: ShardSpec, rank: int, store: Store | None = None) -> protocol.Channel:
    """Join the process group (this rank's GPU made current first) and open the channel
    rank 0 sends its steps over (protocol.py: its gloo group is made right after joining,
    at the same point on every rank). `store`: one this process reached already (torchrun's,
    launch.py), used instead of `spec.init_method`."""
    use_rank_device(spec, rank)
    dist.init_process_group(
        spec.backend,
        init_method=spec.init_method if store is None else None,
        # The prefix init_process_group puts on a store it makes itself from an init_method.
        store=PrefixStore("default_pg", store) if store is not None else None,
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    return protocol.Channel.open(spec.device(rank))


# torch's CPU threads per rank while its shard is read and cut. Each rank would take one per
# core, and every rank's many small index ops then wait on the others' threads and on the
# read threads: on 2x H100 (32 cores) a 70B TP=2 load took 34.1 s with rank 0 at torch's 32
# threads and 21.2 s at 4 (rank 0's read-and-cut 29.6 -> 10.6 s).
LOAD_THREADS_MAX = 4


def load_threads(world_size: int) -> AbstractContextManager[None]:
    """torch uses at most LOAD_THREADS_MAX threads, and no more than this rank's share of
    the cores, inside the block; the process's count is restored after."""
    share = max(1, (os.cpu_count() or 1) // max(world_size, 1))
    return cpu_threads(max(1, min(torch.get_num_threads(), share, LOAD_THREADS_MAX)))


def build_rank(
    spec: ShardSpec, rank: int, phases: LoadPhases | None = None
) -> tuple[CausalLM, PagedKVCache, DecodeGraphs | None, ModelConfig]:
    """This rank's model shard, its KV cache (its KV heads only) and decode graphs, in a
    process that has joined the group (or, on the CPU, needs none): load_rank, then
    finish_rank. `phases`: where to note how long each step took (load_phases.py)."""
    phases = phases if phases is not None else LoadPhases()
    model, cache, config = load_rank(spec, rank, phases)
    return model, cache, finish_rank(model, cache, spec, rank, phases), config


def load_rank(
    spec: ShardSpec, rank: int, phases: LoadPhases
) -> tuple[CausalLM, PagedKVCache, ModelConfig]:
    """The part of a rank's start that needs no process group: its shard read, cut and on
    its device, and its KV cache. The ranks do this before they join the group, so that the
    ones already started read while the others still start up."""
    use_rank_device(spec, rank)
    device = spec.device(rank)
    # Nothing is imported in a thread from here on: it would stall the reads (all_reduce.py's
    # preimport_symmetric_memory says why); the ranks start those imports where they wait.
    with phases.phase("staging plan"):
        config = ModelConfig.from_dir(spec.model_dir)
        dtype = DTYPES[spec.dtype]
        placement = _staging(spec, config, device)
    store = WeightStore(spec.model_dir)
    started = time.perf_counter()
    with phases.phase("read and cut shard"), load_threads(spec.world_size):
        model = load_rank_shard(
            spec.model_dir,
            rank=rank,
            world=spec.world_size,
            device=device,
            dtype=dtype,
            config=config,
            placement=placement,
            store=store,
            phases=phases,
        )
        if device.type == "cuda":
            # The copies and kernels the load queued belong to this phase, not the next.
            torch.cuda.synchronize(device)
    # The quantized linears' reads ran on a read-ahead worker beside the counters below:
    # what they cost this thread is the time it waited for them (engine/read_ahead.py).
    counted = store.read_seconds + store.place_seconds - store.ahead_seconds
    counted += store.ahead_wait_seconds
    phases.counts.update(
        weight_bytes_kept=store.bytes_read,
        file_bytes_read=store.file_bytes,
        read_calls=store.read_calls,
        read_s=round(store.read_seconds, 3),
        place_s=round(store.place_seconds, 3),  # cast, finite check, copy to the device
        stage_buffers=store.reader.buffer_allocations,
        stage_wait_s=round(store.reader.wait_seconds, 3),  # in read_s: copies not done yet
        ahead_s=round(store.ahead_seconds, 3),  # of read_s and place_s: the worker's
        ahead_wait_s=round(store.ahead_wait_seconds, 3),  # this thread waiting for them
    )
    counted += sum(
        float(phases.counts.get(k, 0.0)) for k in ("cut_plan_s", "cut_s", "repack_s", "shard_s")
    )
    # What no counter above holds (the build on the meta device, the small tensors' index
    # work, Python between the reads): a large remainder is the next thing to profile.
    phases.counts["read_cut_other_s"] = round(time.perf_counter() - started - counted, 3)
    with phases.phase("move to device"):
        move_model(model, device)
    with phases.phase("cache"):
        cache = _rank_cache(spec, config, model, device)
    return model, cache, config


def finish_rank(
    model: CausalLM, cache: PagedKVCache, spec: ShardSpec, rank: int, phases: LoadPhases
) -> DecodeGraphs | None:
    """After joining the group, at the same point on every rank (the all-reduce's set-up
    is a collective): the all-reduces, and the decode graphs' holder."""
    device = spec.device(rank)
    with phases.phase("symmetric-memory imports"):  # started where the rank waited, if it did
        finish_symmetric_memory_imports(device)
    with phases.phase("all-reduce set-up"):
        use_all_reduce(model, GroupAllReduce(None, device))
    if spec.cuda_graphs and device.type == "cuda":
        return DecodeGraphs(model, cache, spec.max_seq_len)
    return None


def _rank_cache(
    spec: ShardSpec, config: ModelConfig, model: CausalLM, device: torch.device
) -> PagedKVCache:
    """The rank's rotary tables and KV cache (its KV heads)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the staged whole layers, now cut, and their pool
    model.setup_rotary(spec.max_seq_len, rope_alpha=spec.rope_alpha, rope_scale=spec.rope_scale)
    return PagedKVCache(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads // spec.world_size,
        head_dim=config.head_dim,
        num_pages=spec.cache_pages,
        page_size=spec.page_size,
        dtype=DTYPES[spec.dtype],
        layer_devices=model.layer_devices,
        cache_type=spec.cache_type,
    )


def load_rank_shard(
    model_dir: str,
    *,
    rank: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    config: ModelConfig,
    placement: Placement,
    store: WeightStore | None = None,
    phases: LoadPhases | None = None,
) -> CausalLM:
    """Rank `rank`'s shard of the model, reading only its parts of the weights
    (cut_load.py), not yet moved to `device` from where `placement` staged it. `store`:
    the model's WeightStore to read through (it counts the bytes read). `phases`: where the
    cut plan and the cuts add their seconds."""
    cuts = RankCuts(rank, world)
    phases = phases if phases is not None else LoadPhases()
    # The pieces read are mostly the shards themselves now. The load reads them on a
    # read-ahead worker (engine/read_ahead.py), whose allocations the staging pool does not
    # take (it routes one thread's): a piece kept as it is stays in the common pool, and
    # what the repacks and cuts make (their temporaries, the cut shards) comes from the
    # staging pool. rank_memory's torch_reserved against torch_allocated shows what is left
    # (within 0.5% on each 70B TP=2 rank, 2x H200, session 29).
    with staging_pool(device):
        model = load_causal_lm(
            model_dir,
            device=device,
            dtype=dtype,
            config=config,
            placement=placement,
            cuts=cuts,
            store=store,
        )
    cuts.finish(model)
    assert cuts.vocab is not None
    started = time.perf_counter()
    shard = shard_model(model, rank=rank, world=world, loaded=cuts.vocab)
    phases.counts.update(
        cut_plan_s=round(cuts.plan_seconds, 3),
        cut_s=round(cuts.cut_seconds, 3),
        repack_s=round(cuts.repack_seconds, 3),
        shard_s=round(time.perf_counter() - started, 3),
    )
    return shard


def rank_memory(model: CausalLM, cache: PagedKVCache, device: torch.device) -> dict[str, int]:
    """Bytes this rank holds, by part (engine.held_bytes), and on a GPU what torch's
    allocator has allocated and reserved there and what the device has in use in all (the
    CUDA context, NCCL's buffers and other processes included): reserved well above
    allocated is memory the staging left fragmented."""
    report = held_bytes(model, cache)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        report["torch_allocated"] = torch.cuda.memory_allocated(device)
        report["torch_reserved"] = torch.cuda.memory_reserved(device)
        report["device_used"] = total - free
    return report


def exchange_rank_reports(
    memory: dict[str, int], phases: LoadPhases
) -> tuple[list[dict[str, int]], list[dict[str, object]]]:
    """Every rank's rank_memory and load phases, by rank (a collective: every rank calls it
    once it is ready, before serving)."""
    reports: list[tuple[dict[str, int], dict[str, object]] | None] = [None] * (
        dist.get_world_size()
    )
    dist.all_gather_object(reports, (memory, phases.report()))
    return [r[0] if r else {} for r in reports], [r[1] if r else {} for r in reports]


def _staging(spec: ShardSpec, config: ModelConfig, device: torch.device) -> Placement:
    """Where this rank loads each layer before cutting its shard (staging.py)."""
    weights = model_footprint(
        WeightStore(spec.model_dir),
        config,
        dtype=DTYPES[spec.dtype],
        cache_tokens=0,  # the cache comes after the shards: weights only here
        page_size=spec.page_size,
        prefill_chunk=1,
    )
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    return staging_placement(weights, spec.world_size, device, free)


def serve(rank: ServingRank, channel: protocol.Channel, max_seq_len: int) -> None:
    """Ranks > 0: run what rank 0 announces until STOP, on what `rank` holds (decode graphs
    that rank 0 asks for are kept there too). Nothing here reads the device: the host takes
    the next header while the GPU still runs the last step. Nothing is kept in this
    function's locals past it: leaving (leave.py) lets go of `rank`'s graphs."""
    model, cache = rank.model, rank.cache
    assert model is not None and cache is not None
    with torch.inference_mode():
        while True:
            header = channel.receive_header()
            command = header[0]
            if command == protocol.STOP:
                return
            if command == protocol.FORWARD:
                model(channel.receive_batch(header), cache)
            elif command in (protocol.GRAPH_DECODE, protocol.GRAPH_PROMPT, protocol.GRAPH_MANY):
                graphs = rank.graphs
                if graphs is None:
                    raise RuntimeError("rank 0 replays graphs, this rank has none")
                # Captured now if new, as on rank 0.
                if command == protocol.GRAPH_DECODE:
                    graph = graphs.graph(header[1])
                elif command == protocol.GRAPH_PROMPT:
                    graph = graphs.prompt_graph(header[1])
                else:
                    graph = graphs.graph(header[1], tokens_per_row=header[2])
                channel.broadcast_rows(graph.device_rows)
                graph.replay()
            elif command == protocol.GRAPHS:
                if rank.graphs is not None:
                    raise RuntimeError("rank 0 made decode graphs twice")
                rank.graphs = DecodeGraphs(model, cache, max_seq_len, capture=bool(header[1]))
            else:
                raise RuntimeError(f"unknown tensor-parallel command {command}")


def worker_main(
    rank: int,
    spec: ShardSpec,
    reports: Queue[tuple[int, str | None]],
    phases: LoadPhases | None = None,
) -> None:
    """A spawned rank (> 0), once it has its spec (spawned.py). Loads its shard, reports
    (rank, None), then joins the group (rank 0 joins once every rank has reported: a rank
    that failed before joining cannot leave it waiting in the rendezvous). Reports (rank,
    error text) if loading failed or, later, a step failed (rank 0 adds it to the error it
    raises when the rank stops answering). Told to stop, it leaves with the other ranks
    (leave.py) and ends."""
    phases = phases if phases is not None else LoadPhases(origin=spec.started_at or time.time())
    try:
        serving = ServingRank(*load_rank(spec, rank, phases)[:2])
    except Exception as e:  # noqa: BLE001 - the message goes back to rank 0
        reports.put((rank, f"{type(e).__name__}: {e}"))
        return
    # Beside the report and the rendezvous: this rank waits there if rank 0 is not done.
    preimport_symmetric_memory(spec.device(rank))
    reports.put((rank, None))
    try:
        with phases.phase("join group"):
            channel = init_rank(spec, rank)
    except Exception as e:  # noqa: BLE001
        reports.put((rank, f"process-group init failed: {type(e).__name__}: {e}"))
        return
    try:
        finish_serving_rank(serving, spec, rank, phases)
        serve(serving, channel, spec.max_seq_len)
    except Exception as e:
        reports.put((rank, f"{type(e).__name__}: {e}"))
        reports.close()
        reports.join_thread()  # delivered before the process ends
        traceback.print_exc()
        sys.stderr.flush()
        # No teardown: a peer may be stuck in a collective with this rank, and process
        # groups still alive at interpreter exit abort it (std::terminate). The process
        # ends now; its links close with it, so rank 0's next message fails at once.
        os._exit(1)
    leave_group(channel, serving.release())


def finish_serving_rank(
    serving: ServingRank, spec: ShardSpec, rank: int, phases: LoadPhases
) -> None:
    """finish_rank for a rank > 0, then its reports exchanged with the others: it is ready to
    serve."""
    model, cache = serving.model, serving.cache
    assert model is not None and cache is not None
    serving.graphs = finish_rank(model, cache, spec, rank, phases)
    exchange_rank_reports(rank_memory(model, cache, spec.device(rank)), phases)
