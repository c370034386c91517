"""Where the decode GEMV's chunk loop is software-pipelined (GemvConfig.stages,
kernels/quant_matmul/gemv.py's `_gemv_stages`): only where a program walks at least as
many chunks as there are stages and the grid is about one wave. The staged loop's results
are checked with the plain loop's cases in test_quant_matmul_kernels.py."""

from __future__ import annotations

import pytest
import torch

from helpers.quant_weights import make_weight
from kernels.quant_matmul import gemv, split_k


def _config(num_warps: int = 2, max_iters: int = 8, stages: int = 3) -> gemv.GemvConfig:
    return gemv.GemvConfig(
        num_warps=num_warps, cols_per_thread=(2, 2, 2, 2), programs_per_sm=1,
        max_iters=max_iters, prefetch=True, stages=stages,
    )  # fmt: skip


def _stages(k: int, n: int, config: gemv.GemvConfig, sms: int, monkeypatch) -> tuple[int, int]:
    monkeypatch.setattr(split_k, "sm_count", lambda device: sms)
    monkeypatch.setattr(gemv, "sm_count", lambda device: sms)
    qw = make_weight(k, n, [4], device="cpu")
    tiling = gemv.gemv_tiling(torch.zeros(1, k, dtype=torch.float16), qw, config)
    return tiling.iters, tiling.stages


@pytest.mark.parametrize(
    "k,n,sms,max_iters,want_iters,want_stages",
    [
        # One program per SM, 8 chunks each: staged.
        (1024, 256, 1, 8, 8, 3),
        # Chunks capped at 2 a program: shorter than the pipeline, plain.
        (1024, 256, 1, 2, 2, 1),
        # One SM, 256 rows x 4096 columns: 2 chunks a program (the cap), plain.
        (256, 4096, 1, 2, 2, 1),
    ],
)
def test_stages_only_where_the_loop_is_long_enough(
    k: int, n: int, sms: int, max_iters: int, want_iters: int, want_stages: int, monkeypatch
) -> None:
    config = _config(max_iters=max_iters)
    assert _stages(k, n, config, sms, monkeypatch) == (want_iters, want_stages)


def test_many_waves_keep_the_plain_loop(monkeypatch) -> None:
    # 64 column tiles of 64 columns x 8 chunks of 32 rows: 64 programs on one SM, above
    # _STAGED_MAX_PROGRAMS_PER_SM; on 8 SMs the same grid is one wave and is staged.
    config = _config(num_warps=1)
    assert _stages(256, 4096, config, 1, monkeypatch) == (8, 1)
    assert _stages(256, 4096, config, 8, monkeypatch) == (8, 3)


def test_stages_one_is_the_plain_loop(monkeypatch) -> None:
    assert _stages(1024, 256, _config(stages=1), 1, monkeypatch) == (8, 1)
