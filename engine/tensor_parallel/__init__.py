"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU).

shard.py      slicing one dense or quantized linear by columns or rows (exact, no dequant)
transform.py  a loaded model -> one rank's shard (heads, MLP columns, all-reduces)
protocol.py   what rank 0 broadcasts each step
rank.py       building a rank's shard and cache; the worker loop of ranks > 0
engine.py     rank 0: the launcher (spawns the workers) and TensorParallelEngine
"""
