#!/usr/bin/env bash
# Session 28, issue 33 (kind nvidia-h200-x2, timeout 200): the multi-GPU TP tests again, the
# prompt-slice test first of them (a process sets up symmetric memory for its first TP launch).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KESTREL_TP_PEER_TIMEOUT_S=30
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$SECONDS
timeout 180 python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_multigpu.py \
    -k "tensor_parallel" -rs > $OUT/test_multigpu.txt 2>&1
echo "test_multigpu tp rc=$? t=$((SECONDS-S))"; tail -4 $OUT/test_multigpu.txt
