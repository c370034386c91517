"""Tensor parallelism with ranks started by torchrun (engine/tensor_parallel/launched.py):
the issue-33 command on the CPU (gloo) prints what one process prints."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.tensor_parallel.launched import LaunchedRank, launched_rank
from engine.tensor_parallel.rank import ShardSpec
from helpers.model_factory import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str]) -> str:
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [["-t", "0"], ["-t", "1.0", "--seed", "7"]])
def test_torchrun_ranks_print_what_one_process_prints(tmp_path: Path, sampling: list[str]):
    model = tmp_path / "tiny"
    make_tiny_llama(model)
    common = [str(model), "--device", "cpu", "-p", "hello world", "-n", "16", *sampling]
    one = _run([sys.executable, "-m", "loader", *common])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                "--nproc-per-node", "2", "--master-port", str(_free_port())]  # fmt: skip
    two = _run([*torchrun, "-m", "loader", *common, "--tp"])
    assert one.strip(), "the single process printed no text"
    assert two == one


def test_launched_rank_reads_torchruns_environment() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    assert launched_rank(env) == LaunchedRank(rank=3, world_size=4, local_rank=1,
                                              local_world_size=2)  # fmt: skip
    assert launched_rank({k: v for k, v in env.items() if k != "MASTER_PORT"}) is None
    with pytest.raises(ValueError, match="torchrun's environment"):
        launched_rank({**env, "RANK": "three"})


def test_a_rank_uses_the_gpu_of_its_own_machine() -> None:
    # Two machines of 2 GPUs: ranks 2 and 3 are GPUs 0 and 1 of the second machine.
    spec = ShardSpec("m", 4, "cuda", "float16", "fp16", 64, 1, 64, 1.0, False, "env://",
                     local_world_size=2)  # fmt: skip
    assert [spec.device(r) for r in range(4)] == [torch.device("cuda", i) for i in (0, 1, 0, 1)]
    spawned = ShardSpec("m", 2, "cuda", "float16", "fp16", 64, 1, 64, 1.0, False, "tcp://x")
    assert spawned.device(1) == torch.device("cuda", 1)


def test_other_ranks_take_rank_0s_spec_through_the_store(tmp_path: Path) -> None:
    # Rank 0's spec (its cache size, sequence length, dtype ...) is what rank 1 loads with;
    # only where the model lives on rank 1's machine, its ranks per machine and its clock
    # are its own. A different model there, or rank 0 failing first, is said by name.
    from torch.distributed import TCPStore

    from engine.tensor_parallel.errors import TensorParallelError
    from engine.tensor_parallel.shared_spec import publish_spec, receive_spec

    here, there, other = tmp_path / "here", tmp_path / "there", tmp_path / "other"
    for path, layers in ((here, 2), (there, 2), (other, 3)):
        path.mkdir()
        (path / "config.json").write_text(f'{{"num_hidden_layers": {layers}}}')
    spec = ShardSpec(str(here), 2, "cpu", "float32", "q8", 96, 7, 16, 1.0, False, "env://",
                     local_world_size=2, started_at=1.0)  # fmt: skip
    rank1 = LaunchedRank(rank=1, world_size=2, local_rank=1, local_world_size=2)
    store = TCPStore("127.0.0.1", _free_port(), is_master=True, wait_for_workers=False)
    publish_spec(store, spec)
    got = receive_spec(store, rank1, there, started_at=5.0, timeout_s=10)
    assert got == ShardSpec(str(there), 2, "cpu", "float32", "q8", 96, 7, 16, 1.0, False,
                            "env://", local_world_size=2, started_at=5.0)  # fmt: skip
    with pytest.raises(TensorParallelError, match="config.json files differ"):
        receive_spec(store, rank1, other, started_at=5.0, timeout_s=10)
    failed = TCPStore("127.0.0.1", _free_port(), is_master=True, wait_for_workers=False)
    publish_spec(failed, None, "ValueError: max_seq_len must be positive, got -1")
    with pytest.raises(TensorParallelError, match="rank 0 did not load: ValueError: max_seq"):
        receive_spec(failed, rank1, there, started_at=5.0, timeout_s=10)
