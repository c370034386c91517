"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU).

shard.py      slicing one dense or quantized linear by columns or rows (exact, no dequant)
transform.py  a loaded model -> one rank's shard (heads, MLP columns, all-reduces)
protocol.py   what rank 0 sends each step: headers over gloo (host), graph rows on the device
rank.py       building a rank's shard and cache; the worker loop of ranks > 0
spawned.py    starting ranks 1.. on this machine (first thing, or ahead of the launch)
load_phases.py  where each rank's load time went (gathered by rank 0)
launch.py     rank 0: the launcher (spawns or joins the ranks, builds an Engine around...)
runner.py     ...a TensorParallelRunner: broadcasts each step, holds and stops the ranks
ranks.py      the ranks rank 0 holds, and leaving the group
"""
