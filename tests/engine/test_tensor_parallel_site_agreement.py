"""Every rank takes the decode site all-reduce, or none does (issue 33).

The site kernels wait for every peer's partial: a rank that set its buffers up while a peer
could not (its allocation, its environment, its view of the peers' addresses), or that ran
the other kernel, would leave its peers waiting for good. SiteAllReduce.build makes the
ranks agree after each step of the set-up. Two gloo ranks on the CPU decide here, every
case in one launch (a launch costs tens of seconds on a loaded 2-core machine): the votes
themselves, a kernel named on one rank only, and the whole build where no rank has
symmetric memory (the CPU), which must return None on both without waiting."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2

# Per case, what each rank passes to sites_agreed: (ok, kernel).
VOTES = {
    "all_ok": [(True, "push"), (True, "push")],
    "one_failed": [(True, "flags"), (False, "flags")],
    "kernels_differ": [(True, "push"), (True, "flags")],
    "one_refused": [(True, "push"), (True, None)],
}
CASES = [*VOTES, "build", "build_kernels_differ"]


def _case(rank: int, case: str) -> object:
    from engine.tensor_parallel.site_reduce import SiteAllReduce, sites_agreed

    group = dist.group.WORLD
    assert group is not None
    cpu = torch.device("cpu")
    try:
        if case == "build":
            # No symmetric memory on the CPU: every rank must see it and return None.
            return SiteAllReduce.build(None, cpu, sites=4, hidden=64) is None
        if case == "build_kernels_differ":
            SiteAllReduce.build(None, cpu, 4, 64, kernel=["push", "flags"][rank])
            return "built"
        return sites_agreed(group, cpu, *VOTES[case][rank])
    except ValueError as error:
        return f"ValueError: {error}"


def _rank(rank: int, tmp: str, results: dict) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{Path(tmp) / 'store'}", rank=rank, world_size=WORLD
    )
    try:
        results[rank] = {case: _case(rank, case) for case in CASES}
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_the_same_path(tmp_path: Path) -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path), results), nprocs=WORLD, join=True)
        decided = {case: [results[rank][case] for rank in range(WORLD)] for case in CASES}
    assert decided["all_ok"] == [True, True]
    assert decided["one_failed"] == [False, False]
    assert decided["build"] == [True, True]
    raised = {
        "kernels_differ": "different site all-reduce kernels ('flags' and 'push')",
        "one_refused": "KESTREL_TP_SITE_KERNEL is not one of",
        "build_kernels_differ": "different site all-reduce kernels ('flags' and 'push')",
    }
    for case, message in raised.items():
        for answer in decided[case]:
            assert isinstance(answer, str) and answer.startswith("ValueError"), (case, answer)
            assert message in answer, (case, answer)
