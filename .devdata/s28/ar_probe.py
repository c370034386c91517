"""Session 28, issue 33: prefill-sized all-reduces on 2 GPUs (fp16 [rows, 4096]), µs each:
NCCL as the engine calls it (dist.all_reduce), under the NCCL_PROTO of the environment, and
torch's symmetric-memory one-shot / two-shot all-reduce (copy into a symmetric buffer, reduce,
copy out). Usage: python ar_probe.py OUT.json  (env NCCL_PROTO to compare protocols)."""
import json, os, socket, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

ROWS = (1, 16, 128, 512, 1024, 2048)


def timed(fn, reps=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    import torch.distributed._symmetric_memory as symm
    name = dist.group.WORLD.group_name
    buf = symm.empty(2048 * 4096, dtype=torch.float16, device=dev)
    symm.rendezvous(buf, name)
    res = {}
    for rows in ROWS:
        n = rows * 4096
        y = torch.randn(rows, 4096, device=dev, dtype=torch.float16)
        ref = y.clone(); dist.all_reduce(ref)
        r = {"nccl": timed(lambda: dist.all_reduce(y))}
        view = buf[:n]

        def two_shot():
            view.copy_(y.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", name)
            return view.view(rows, 4096).clone()

        def one_shot():
            view.copy_(y.view(-1))
            return torch.ops.symm_mem.one_shot_all_reduce(view, "sum", name)

        for k, fn in (("symm_two_shot", two_shot), ("symm_one_shot", one_shot)):
            try:
                got = fn()
                y2 = torch.randn(rows, 4096, device=dev, dtype=torch.float16)
                r[k] = timed(fn)
                r[k + "_max_err_vs_nccl"] = float((got.view(rows, 4096).float() - ref.float()).abs().max())
            except Exception as e:
                r[k] = f"{type(e).__name__}: {e}"[:200]
        res[rows] = r
    if rank == 0:
        res = {"nccl_proto": os.environ.get("NCCL_PROTO", "(default)"), "rows": res,
               "gpus": [torch.cuda.get_device_name(i) for i in range(world)]}
        json.dump(res, open(out, "w"), indent=1)
        print(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(worker, args=(2, port, sys.argv[1]), nprocs=2)
