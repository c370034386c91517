"""The site all-reduce kernel (kernels/tp_all_reduce.py) on 2+ GPUs of one host: results,
ordering and speed, without a model.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
        python tools/check_tp_all_reduce.py --kernel flags push --out DIR

--kernel: the exchange kernels to check, one after the other (engine/tensor_parallel/
site_reduce.py: `flags`, kernels/tp_all_reduce.py; `push`, kernels/tp_push_all_reduce.py).

Spawns one process per GPU (NCCL group, symmetric memory as the engine sets it up:
engine/tensor_parallel/site_reduce.py). Every rank draws every rank's partials from shared
seeds, so each can compute the expected result itself:
  - eager: --steps steps over --sites sites, rows cycling 1..max, alternately the sum
    (all-reduce + cast) and the sum + residual add + RMSNorm; each result compared bit for
    bit with torch's rank-order float32 sum cast to float16, and the fused norm with
    kernels.add_rms_norm on that sum; the results' checksums compared across ranks;
  - CUDA graph: the same sequence captured once and replayed with new partials (the
    epochs advance in device memory), checked the same way;
  - speed: a graph of 2 x --layers all-reduces of one 4096-wide row (an 8B model's decode
    step), µs per all-reduce for this kernel, this kernel with the norm, and torch's
    one-shot all-reduce + cast (what the engine ran before).
Writes <out>/check_tp_all_reduce-<kernel>.json (rank 0) and prints a summary; exits 1 on a
mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 4096
EPS = 1e-5


def _partials(world: int, rows: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(rows, HIDDEN, generator=g, device=device) * 4 for _ in range(world)]


def _expected(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for p in parts[1:]:
        total = total + p
    return total.half()


def _check_step(
    sites: Any, rank: int, world: int, site: int, rows: int, seed: int, outputs: dict[str, Any]
) -> int:
    """One site call; returns its mismatches. The inputs come from `seed`."""
    from kernels.rms_norm import add_rms_norm

    device = sites.buffers.data.device
    parts = _partials(world, rows, seed, device)
    staged = sites.staging(site, (rows, HIDDEN))
    staged.copy_(parts[rank])
    expected = _expected(parts)
    if site % 2:
        got = sites.sum(site, staged, torch.float16)
        bad = int((got.view(torch.int16) != expected.view(torch.int16)).sum())
        outputs["checksum"] += float(got.float().sum())
        return bad
    g = torch.Generator(device=device).manual_seed(seed + 1)
    residual = torch.randn(rows, HIDDEN, generator=g, device=device).half()
    weight = (torch.rand(HIDDEN, generator=g, device=device) + 0.5).half()
    normed, summed = sites.add_rms_norm(site, residual, weight, EPS, unit_offset=False)
    ref_normed, ref_summed = add_rms_norm(expected, residual, weight, EPS)
    outputs["checksum"] += float(normed.float().sum())
    return int((normed.view(torch.int16) != ref_normed.view(torch.int16)).sum()) + int(
        (summed.view(torch.int16) != ref_summed.view(torch.int16)).sum()
    )


def _speed(sites: Any, layers: int, reps: int) -> dict[str, float]:
    """µs per all-reduce of one row in a graph of 2 * layers calls, three ways."""
    from engine.tensor_parallel.all_reduce import GroupAllReduce

    device = sites.buffers.data.device
    n = min(2 * layers, sites.buffers.sites)
    one_shot = GroupAllReduce(None, device)
    residual = torch.randn(1, HIDDEN, device=device).half()
    weight = torch.ones(HIDDEN, device=device).half()

    def fused_sum() -> None:
        for s in range(n):
            sites.sum(s, sites.staging(s, (1, HIDDEN)), torch.float16)

    def fused_norm() -> None:
        for s in range(n):
            sites.add_rms_norm(s, residual, weight, EPS, unit_offset=False)

    def torch_one_shot() -> None:
        staged = one_shot.staging((1, HIDDEN))
        for _ in range(n):
            one_shot.sum_staged(staged).to(torch.float16)

    result = {}
    for name, body in (
        ("site_sum_us", fused_sum),
        ("site_sum_add_norm_us", fused_norm),
        ("torch_one_shot_cast_us", torch_one_shot),
    ):
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            body()  # warm-up: compiles, and every rank in step
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        graph.replay()
        torch.cuda.synchronize(device)
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        result[name] = round(start.elapsed_time(end) * 1000 / (reps * n), 2)
    return result


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    from engine.tensor_parallel.site_reduce import SiteAllReduce

    sites = SiteAllReduce.build(None, device, args.sites, HIDDEN, kernel=args.kernel)
    assert sites is not None, "the site all-reduce could not be set up (see the log)"
    max_rows = sites.buffers.max_rows
    outputs: dict[str, Any] = {"checksum": 0.0}
    eager_bad = 0
    for step in range(args.steps):
        rows = 1 + step % max_rows
        for site in range(args.sites):
            eager_bad += _check_step(sites, rank, world, site, rows, 1000 * step + site, outputs)
    torch.cuda.synchronize(device)

    # A captured sequence replayed with new partials: the same calls, epochs in device memory.
    rows = min(4, max_rows)
    sources = [torch.zeros(world, rows, HIDDEN, device=device) for _ in range(args.sites)]
    results: list[torch.Tensor] = []
    stream = torch.cuda.Stream(device)

    def captured() -> list[torch.Tensor]:
        outs = []
        for site in range(args.sites):
            staged = sites.staging(site, (rows, HIDDEN))
            staged.copy_(sources[site][rank])
            outs.append(sites.sum(site, staged, torch.float16))
        return outs

    with torch.cuda.stream(stream):
        captured()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = captured()
    graph_bad = 0
    for replay in range(args.replays):
        expected = []
        for site in range(args.sites):
            parts = _partials(world, rows, 7_000_000 + 100 * replay + site, device)
            sources[site].copy_(torch.stack(parts))
            expected.append(_expected(parts))
        graph.replay()
        torch.cuda.synchronize(device)
        for got, exp in zip(results, expected, strict=True):
            graph_bad += int((got.view(torch.int16) != exp.view(torch.int16)).sum())
            outputs["checksum"] += float(got.float().sum())
    epochs = sites.buffers.epochs.cpu()

    speed = _speed(sites, args.layers, args.reps)
    # Every rank must hold the same bits: compare the checksums of everything computed.
    sums = [None] * world
    dist.all_gather_object(sums, outputs["checksum"])
    report = {
        "kernel": args.kernel,
        "gpus": [torch.cuda.get_device_name(i) for i in range(world)],
        "world": world,
        "sites": args.sites,
        "max_rows": max_rows,
        "eager_steps": args.steps,
        "eager_mismatched_elements": eager_bad,
        "graph_replays": args.replays,
        "graph_mismatched_elements": graph_bad,
        "epochs_site0": epochs[0, :rows].tolist(),
        "push_next_slots": None if sites.push is None else sites.push.slots[:rows].tolist(),
        "ranks_same_bits": len(set(sums)) == 1,
        "speed": speed,
        "ok": eager_bad == 0 and graph_bad == 0 and len(set(sums)) == 1,
    }
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"check_tp_all_reduce-{args.kernel}.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if not report["ok"]:
        sys.exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sites", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--layers", type=int, default=32, help="speed: 2 all-reduces per layer")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--kernel", nargs="+", choices=["flags", "push"], default=["flags"])
    p.add_argument("--out", default=".")
    args = p.parse_args()
    for kernel in args.kernel:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        one = argparse.Namespace(**{**vars(args), "kernel": kernel})
        mp.spawn(_worker, args=(args.world, port, one), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
