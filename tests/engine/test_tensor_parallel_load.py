"""How a tensor-parallel load starts its ranks and accounts for its time (issue 33), on the
CPU (gloo): ranks started ahead of the launch (spawned.prestart, as the CLI does for --tp N)
are the ones the launch uses, every rank reports its load phases to rank 0, and ranks that
no launch takes end."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import loader
from engine.tensor_parallel import spawned
from engine.tensor_parallel.errors import TensorParallelError
from engine.tensor_parallel.rank import ShardSpec
from helpers.mixed_model import build_mixed_model

ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ban_eos_token": True}
IDS = [5, 17, 33, 101, 7, 250, 12, 9, 64, 3]


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mixed_model(tmp_path_factory.mktemp("tp_load"))


def _names(report: dict[str, object]) -> list[str]:
    spans = report["spans"]
    assert isinstance(spans, list)
    return [name for name, _, _ in spans]


def test_prestarted_ranks_serve_the_launch_and_every_rank_reports_its_phases(mixed_model: Path):
    single = loader.load(mixed_model, "kestrel", device="cpu", dtype="float32")
    expected = single.generate(IDS, GREEDY)
    single.unload()

    spawned.prestart(2)
    prestarted = spawned._prestarted
    assert prestarted is not None
    pids = [p.pid for p in prestarted.processes]
    tp = loader.load(mixed_model, "kestrel", device="cpu", dtype="float32", tp=2)
    try:
        ranks = tp.engine.runner.ranks
        assert spawned._prestarted is None  # taken by the launch
        assert [w.pid for w in ranks.workers] == pids
        assert tp.generate(IDS, GREEDY) == expected
        zero, one = ranks.load_phases
        for report in (zero, one):
            names = _names(report)
            for phase in ("join group", "read and cut shard", "all-reduce set-up", "cache"):
                assert phase in names, (phase, names)
            # every rank read its shard through the weight files' reads
            assert 0 < report["weight_bytes_kept"] <= report["file_bytes_read"]
            assert report["read_calls"] > 0
        assert _names(zero)[:3] == ["spawn ranks", "shard spec", "staging plan"]
        assert _names(one)[:3] == ["process start", "import", "wait for spec"]
        # Rank 1 began before the launch did (its times count from the launch's start),
        # and had imported torch and the engine before it was given its spec.
        spans = {name: (start, end) for name, start, end in one["spans"]}
        assert spans["process start"][0] < 0
        assert spans["import"][1] <= spans["wait for spec"][1]
    finally:
        tp.unload()
    assert all(not w.is_alive() for w in ranks.workers)


def test_prestarted_ranks_of_another_size_or_never_taken_are_stopped(mixed_model: Path):
    spawned.prestart(3)
    three = spawned._prestarted
    assert three is not None
    tp = loader.load(mixed_model, "kestrel", device="cpu", dtype="float32", tp=2)
    try:  # the launch started 2 ranks of its own and stopped the 3 it could not use
        assert all(not p.is_alive() for p in three.processes)
        assert len(tp.engine.runner.ranks.workers) == 1
    finally:
        tp.unload()

    spawned.prestart(2)
    left = spawned._prestarted
    assert left is not None
    spawned.discard_prestarted()
    assert spawned._prestarted is None
    assert all(not p.is_alive() for p in left.processes)


def test_a_rank_that_fails_to_load_is_named_and_rank_0_does_not_wait_for_it(
    mixed_model: Path, tmp_path: Path
):
    # The last vocabulary row, which only rank 1 reads, is NaN: rank 1 fails its load and
    # never joins the group; rank 0, which loads before joining, must not wait for it there.
    broken = tmp_path / "broken"
    shutil.copytree(mixed_model, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.embed_tokens.weight"][-1, 0] = float("nan")
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(
        loader.LoaderError, match=r"rank 1 failed to load: WeightError: tensor 'model.embed_tok"
    ):
        loader.load(broken, "kestrel", device="cpu", dtype="float32", tp=2)
    assert not torch.distributed.is_initialized()


def test_a_rank_whose_launch_never_comes_ends_by_itself():
    ranks = spawned.spawn_ranks(2)
    for conn in ranks.specs:
        conn.close()  # rank 0 gives up before sending the spec (its own load failed)
    ranks.specs = []
    for process in ranks.processes:
        process.join(timeout=300)
        assert process.exitcode == 0


def test_a_rank_gone_before_its_spec_is_a_clear_error():
    ranks = spawned.spawn_ranks(2)
    try:
        ranks.processes[0].kill()
        ranks.processes[0].join(timeout=60)
        spec = ShardSpec("m", 2, "cpu", "float32", "fp16", 64, 1, 64, 1.0, False, "tcp://x")
        with pytest.raises(TensorParallelError, match="rank 1 exited with code -9 before it was"):
            ranks.send_spec(spec)
    finally:
        ranks.stop()


@pytest.mark.slow
def test_cli_tp_prints_what_one_process_prints(mixed_model: Path):
    common = [str(mixed_model), "--device", "cpu", "-p", "hello world", "-n", "8", "-t", "0"]

    def run(extra: list[str]) -> str:
        done = subprocess.run([sys.executable, "-m", "loader", *common, *extra], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    one = run([])
    assert one.strip()
    assert run(["--tp", "2"]) == one
