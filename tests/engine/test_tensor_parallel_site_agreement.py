"""Every rank takes the decode site all-reduce, or none does (issue 33).

The site kernels wait for every peer's partial: a rank that set its buffers up while a peer
could not (its allocation, its environment, its view of the peers' addresses), or that ran
the other kernel, would leave its peers waiting for good. SiteAllReduce.build makes the
ranks agree after each step of the set-up. Two gloo ranks on the CPU decide here, every
case in one launch (a launch costs seconds): the votes themselves; builds where one rank's
allocation or rendezvous fails and the other's succeeds (symmetric memory stood in for by
CPU tensors and a stand-in rendezvous), which must give None on both ranks and never reach
the barrier; a build where both succeed, which must give both ranks their buffers after
the barrier; and kernels that differ between the ranks, which must raise on both."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from helpers.gloo_ranks import run_gloo_ranks

WORLD = 2

# Per case, what each rank passes to sites_agreed: (ok, kernel).
VOTES = {
    "all_ok": [(True, "push"), (True, "push")],
    "one_failed": [(True, "flags"), (False, "flags")],
    "kernels_differ": [(True, "push"), (True, "flags")],
    "one_refused": [(True, "push"), (True, None)],
}
# Per build case: (which ranks allocate, which ranks' rendezvous returns).
BUILDS = {
    "nobody_allocates": ((), ()),
    "one_allocates": ((0,), (0, 1)),
    "one_rendezvous_fails": ((0, 1), (0,)),
    "both_succeed": ((0, 1), (0, 1)),
}
CASES = [*VOTES, *BUILDS, "build_kernels_differ", "fused_off_on_one"]


def _build(rank: int, allocates: tuple[int, ...], meets: tuple[int, ...], **kwargs) -> object:
    """SiteAllReduce.build on the CPU with symmetric memory stood in for: `allocates` ranks
    get a CPU tensor, `meets` ranks a rendezvous handle (the others raise); returns what
    build gave (None, or 'built') and whether the barrier ran."""
    import torch.distributed._symmetric_memory as symm_mem

    from engine.tensor_parallel import site_reduce

    barriers: list[int] = []

    def empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if rank not in allocates:
            raise RuntimeError("no symmetric memory on this rank")
        return torch.empty(numel, dtype=dtype, device=device)

    def rendezvous(buffer: torch.Tensor, group_name: str) -> SimpleNamespace:
        dist.barrier()  # a collective, as torch's exchange of the peers' handles
        if rank not in meets:
            raise RuntimeError("no peer access on this rank")
        base = buffer.data_ptr()
        return SimpleNamespace(
            buffer_ptrs=[base] * WORLD,
            rank=rank,
            world_size=WORLD,
            barrier=lambda: barriers.append(1),
        )

    real_empty, real_rendezvous = site_reduce.symmetric_empty, symm_mem.rendezvous
    site_reduce.symmetric_empty, symm_mem.rendezvous = empty, rendezvous  # type: ignore[assignment]
    try:
        built = site_reduce.SiteAllReduce.build(None, torch.device("cpu"), 4, 64, **kwargs)
    finally:
        site_reduce.symmetric_empty, symm_mem.rendezvous = real_empty, real_rendezvous
    return ("built" if built is not None else None, len(barriers))


def _case(rank: int, case: str) -> object:
    from engine.tensor_parallel.site_reduce import sites_agreed

    group = dist.group.WORLD
    assert group is not None
    try:
        if case in BUILDS:
            return _build(rank, *BUILDS[case])
        if case == "build_kernels_differ":
            return _build(rank, (0, 1), (0, 1), kernel=["push", "flags"][rank])
        if case == "fused_off_on_one":
            return _build(rank, (0, 1), (0, 1), enabled=rank == 0)
        return sites_agreed(group, torch.device("cpu"), *VOTES[case][rank])
    except ValueError as error:
        return f"ValueError: {error}"


def _all_cases(rank: int) -> dict[str, object]:
    # The group's timeout (run_gloo_ranks): a mismatched collective fails, never hangs CI.
    return {case: _case(rank, case) for case in CASES}


def test_every_rank_takes_the_same_path(tmp_path: Path) -> None:
    answers = run_gloo_ranks(_all_cases, tmp_path, WORLD)
    decided = {case: [answers[rank][case] for rank in range(WORLD)] for case in CASES}
    assert decided["all_ok"] == [True, True]
    assert decided["one_failed"] == [False, False]
    # One-sided failures: nobody gets buffers, nobody reaches the barrier.
    for case in ("nobody_allocates", "one_allocates", "one_rendezvous_fails", "fused_off_on_one"):
        assert decided[case] == [(None, 0), (None, 0)], (case, decided[case])
    assert decided["both_succeed"] == [("built", 1), ("built", 1)]
    raised = {
        "kernels_differ": "different site all-reduce kernels ('flags' and 'push')",
        "one_refused": "KESTREL_TP_SITE_KERNEL is not one of",
        "build_kernels_differ": "different site all-reduce kernels ('flags' and 'push')",
    }
    for case, message in raised.items():
        for answer in decided[case]:
            assert isinstance(answer, str) and answer.startswith("ValueError"), (case, answer)
            assert message in answer, (case, answer)
