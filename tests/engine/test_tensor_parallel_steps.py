"""Tensor-parallel steps without host waits (engine/tensor_parallel/protocol.py): the
scheduler's lookahead runs under tensor parallelism as on one device. Rank 0 announces
each step over a gloo group on the host, and a decode step's tokens, drawn on rank 0's
device, go into the decode graph's rows on the device and to the other ranks in those
rows: rank 0 never reads them back before launching the step.

On the CPU (gloo for both planes) the decode graphs' static buffers run eagerly
(`enable_decode_graphs(capture=False)` on every rank), which is the path a GPU takes with
captured graphs; the tokens, greedy and seeded, must equal one process's. A rank that
fails mid-step must end the step with its error, not a hang. The GPU test (2 GPUs)
compares with one GPU and turns torch's sync debug mode to errors around rank 0's decode
steps, so any host wait there fails it."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from engine.engine import Engine, EngineOptions
from engine.tensor_parallel.errors import RankFailedError
from engine.tensor_parallel.launch import launch_tensor_parallel
from engine.tensor_parallel.runner import TensorParallelRunner
from helpers.mixed_model import build_mixed_model

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ban_eos_token": True}
SEEDED = {"max_new_tokens": 12, "temperature": 1.0, "seed": 7, "ban_eos_token": True}


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mixed_model(tmp_path_factory.mktemp("tp_steps"))


def _options(device: str = "cpu") -> EngineOptions:
    return EngineOptions(
        device=device,
        dtype="float32" if device == "cpu" else "float16",
        max_seq_len=256,
        page_size=8,
        cache_tokens=1024,
        max_batch=3,
    )


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def _jobs() -> list[tuple[list[int], dict[str, Any]]]:
    # Three jobs decoding together, greedy and seeded, ending one after another: the
    # lookahead steps move from the graph of bucket 4 to those of 2 and 1, which every
    # rank makes in step when first used.
    return [
        (_prompt(9, 1), GREEDY),
        (_prompt(14, 2), {**SEEDED, "max_new_tokens": 8}),
        (_prompt(6, 3), {**GREEDY, "max_new_tokens": 4}),
    ]


def _run(engine: Engine) -> list[list[int]]:
    """Every job's tokens, submitted at once and stepped together on this thread (a
    stream would step them on the scheduler's step thread, out of HostReads' sight)."""
    sched = engine.scheduler
    jobs = [sched.submit(p, s) for p, s in _jobs()]
    tokens: dict[int, list[int]] = {job.id: [] for job in jobs}
    while not all(job.done for job in jobs):
        for event in sched.step():
            tokens[event.job_id] += event.token_ids
    return [tokens[job.id] for job in jobs]


ENGINE = str(Path(__file__).resolve().parents[2] / "engine")


class HostReads:
    """Calls of Tensor.tolist / Tensor.item that engine/ code makes (at any depth) inside
    `within` on this thread, seen through the interpreter's profiling hook: both are C
    methods, which it reports as c_call events with the calling Python frame. (kernels/'
    CPU reference attention reads its index tensors: on a GPU, Triton kernels run instead.
    `int(tensor)` makes no such event: the placeholder check of the staged rows covers any
    way the token values could reach the host.)"""

    def __init__(self, within: str) -> None:
        self.within = within
        self.calls: list[str] = []

    def _inside(self, frame: FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code.co_name == self.within:
                return True
            frame = frame.f_back
        return False

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "c_call" or getattr(arg, "__name__", None) not in ("tolist", "item"):
            return
        if (
            isinstance(getattr(arg, "__self__", None), torch.Tensor)
            and frame.f_code.co_filename.startswith(ENGINE)
            and self._inside(frame)
        ):
            self.calls.append(f"{arg.__name__} in {frame.f_code.co_filename}:{frame.f_lineno}")

    def __enter__(self) -> HostReads:
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


def test_lookahead_decode_steps_keep_their_tokens_on_the_device(mixed_model: Path) -> None:
    one = Engine.load(mixed_model, _options())
    try:
        expected = _run(one)
    finally:
        one.unload()
    tp = launch_tensor_parallel(mixed_model, _options(), 2)
    try:
        runner = tp.runner
        assert isinstance(runner, TensorParallelRunner)
        graphs = tp.enable_decode_graphs(capture=False)  # on every rank
        channel = runner.channel
        # The control plane is a gloo group of its own beside the data plane's group.
        assert dist.get_backend(channel.control) == "gloo"
        assert channel.control != dist.group.WORLD
        assert dist.get_world_size(channel.control) == 2
        # Each lookahead step as staged on rank 0: the host rows keep the placeholder
        # token and the device rows (broadcast to rank 1 as they are) hold the tokens
        # drawn on the device.
        staged: list[bool] = []
        stage_decode = graphs.stage_decode

        def check_staging(sequences, tokens, **options):  # type: ignore[no-untyped-def]
            graph = stage_decode(sequences, tokens, **options)
            if isinstance(tokens, torch.Tensor):
                n = len(sequences)
                staged.append(
                    bool((graph.host[:n, 0] == 0).all())
                    and torch.equal(graph.device_rows[:n, 0], tokens)
                )
            return graph

        graphs.stage_decode = check_staging  # type: ignore[method-assign]
        headers = channel.headers
        with HostReads("forward_decode_tokens") as reads:
            got = _run(tp)
        assert got == expected
        assert reads.calls == []  # no token read back inside a lookahead step
        # The longest job's 11 forwards after its first token ran ahead (the others' rows
        # in them), through the graph rows, each announced by one header.
        forwards = tp.scheduler.stats()["lookahead_forwards"]
        assert forwards >= 10 and len(staged) == forwards and all(staged)
        assert channel.headers - headers >= forwards
        assert {size for size, _ in graphs._graphs} == {1, 2, 4}  # noqa: SLF001
    finally:
        tp.unload()


def _one_at_a_time(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [
        [t for e in engine.scheduler.stream_many([engine.scheduler.submit(p, GREEDY)])
         for t in e.token_ids]
        for p in prompts
    ]  # fmt: skip


def test_prompts_and_short_steps_run_through_every_ranks_graphs(mixed_model: Path) -> None:
    # A fresh prompt goes through a prompt graph and a few tokens through a multi-token
    # graph, on every rank, as on one device (eager, rank by rank, a prompt paid the host's
    # launch of every kernel on every rank: an 8B prefill at a quarter of one GPU's speed).
    prompts = [_prompt(40, 1), _prompt(5, 2), _prompt(100, 3)]
    one = Engine.load(mixed_model, _options())
    try:
        expected = _one_at_a_time(one, prompts)
    finally:
        one.unload()
    tp = launch_tensor_parallel(mixed_model, _options(), 2)
    try:
        runner = tp.runner
        assert isinstance(runner, TensorParallelRunner)
        graphs = tp.enable_decode_graphs(capture=False)  # on every rank
        assert _one_at_a_time(tp, prompts) == expected
        assert graphs.prompt_steps == 2 and set(graphs._prompt_graphs) == {64, 128}  # noqa: SLF001
        assert (1, 8) in graphs._graphs  # noqa: SLF001 - the 5-token prompt
    finally:
        tp.unload()


def test_a_step_that_fails_on_another_rank_raises_its_error(mixed_model: Path) -> None:
    tp = launch_tensor_parallel(mixed_model, _options(), 2)
    try:
        runner = tp.runner
        assert isinstance(runner, TensorParallelRunner)
        # Graphs made on rank 0 alone (not through enable_decode_graphs): rank 1 fails
        # on the first graph decode step it is sent.
        from engine.cuda_graph import DecodeGraphs

        runner.graphs = DecodeGraphs(tp.model, tp.cache, 256, capture=False)
        job = tp.scheduler.submit(_prompt(9, 1), GREEDY)
        with pytest.raises(RankFailedError, match="rank 1 failed: RuntimeError: rank 0 replays"):
            list(tp.scheduler.stream_many([job]))
        assert job.done and job.error is not None
        # The ranks were stopped: the next step fails at once, saying why.
        assert not any(worker.is_alive() for worker in runner.ranks.workers)
        job = tp.scheduler.submit(_prompt(5, 2), GREEDY)
        with pytest.raises(RankFailedError, match="rank 1 failed: RuntimeError: rank 0 replays"):
            list(tp.scheduler.stream_many([job]))
    finally:
        tp.unload()


def test_a_step_that_fails_on_rank_0_stops_the_other_ranks(mixed_model: Path) -> None:
    # Rank 1 has the step's header and queued its collectives; rank 0 fails before its own
    # (out of memory while staging the rows). Going on would pair the ranks' collectives
    # wrongly, so the step's error stops every rank, and every later call says so.
    tp = launch_tensor_parallel(mixed_model, _options(), 2)
    try:
        runner = tp.runner
        assert isinstance(runner, TensorParallelRunner)
        graphs = runner.enable_decode_graphs(capture=False)

        def out_of_memory(*args: Any) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory (staged by the test)")

        graphs.stage_decode = out_of_memory  # type: ignore[method-assign]
        job = tp.scheduler.submit(_prompt(9, 1), GREEDY)
        expected = "failed on rank 0 .* stopped; load the model again .*OutOfMemoryError"
        with pytest.raises(RankFailedError, match=expected):
            list(tp.scheduler.stream_many([job]))
        assert job.done and job.error is not None
        assert not any(worker.is_alive() for worker in runner.ranks.workers)
        job = tp.scheduler.submit(_prompt(5, 2), GREEDY)
        with pytest.raises(RankFailedError, match=expected):
            list(tp.scheduler.stream_many([job]))
    finally:
        tp.unload()


def test_a_killed_rank_gives_a_clear_error(mixed_model: Path) -> None:
    tp = launch_tensor_parallel(mixed_model, _options(), 2)
    try:
        runner = tp.runner
        assert isinstance(runner, TensorParallelRunner)
        assert len(_run(tp)[0]) == GREEDY["max_new_tokens"]
        worker = runner.ranks.workers[0]
        worker.kill()
        worker.join()
        job = tp.scheduler.submit(_prompt(9, 1), GREEDY)
        with pytest.raises(RankFailedError, match=r"rank 1 exited with code -9"):
            list(tp.scheduler.stream_many([job]))
    finally:
        tp.unload()  # the stop message cannot go out: the unload still ends


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp_decode_steps_wait_for_no_gpu_and_match_one_gpu(mixed_model: Path) -> None:
    one = Engine.load(mixed_model, _options("cuda:0"))
    try:
        expected = _run(one)
    finally:
        one.unload()
    tp = launch_tensor_parallel(mixed_model, _options("cuda"), 2)
    try:
        runner = tp.runner
        assert isinstance(runner, TensorParallelRunner) and runner.graphs is not None
        # Headers on the host (gloo), the rows and the forward's collectives on NCCL.
        assert dist.get_backend(runner.channel.control) == "gloo"
        assert dist.get_backend() == "nccl"
        _run(tp)  # captures the buckets' graphs (a capture waits for the GPU)
        original = runner.forward_decode_tokens
        steps = 0

        def without_host_waits(sequences, tokens):  # type: ignore[no-untyped-def]
            # Any stream/device synchronize or blocking copy (a .tolist(), .item(), a
            # pageable copy) in rank 0's lookahead step raises here.
            nonlocal steps
            steps += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return original(sequences, tokens)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        runner.forward_decode_tokens = without_host_waits  # type: ignore[method-assign]
        got = _run(tp)
        assert steps >= 10
        # Greedy rows equal one GPU's; the seeded row draws from logits the ranks sum in
        # another order, so it is compared for its length only.
        assert got[0] == expected[0] and got[2] == expected[2]
        assert len(got[1]) == _jobs()[1][1]["max_new_tokens"]
    finally:
        tp.unload()
