#!/usr/bin/env bash
# Next GPU session's calls (issues 33, 28), in order; each names its kind, carry and timeout.
#   1. bash .devdata/s28/next.sh tests (nvidia-h200-x2, carry .devdata/s11/w, timeout 300): the
#      whole multi-GPU test file (the prompt-slice test first of its TP tests: never yet passed
#      on a GPU; the quantized-cache TP test not run since the prompt slices landed).
#   2. bash .devdata/s28/next.sh 70b (same warm machine, timeout 590): the 70B one GPU and
#      TP=2 with the prompt slices (prefill P512 was 1.84-1.85x with NCCL), greedy compared.
#   3. bash .devdata/s27/next.sh tp4 (nvidia-h200-x4 if lent): the 70B TP=4 critical path.
set -u
[ -d /tmp/site/llguidance ] || pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 KESTREL_TP_PEER_TIMEOUT_S=30
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$SECONDS
case "${1:-}" in
tests)
    timeout 280 python -m pytest -q -m gpu -p no:cacheprovider -rs tests/engine/test_multigpu.py \
        > $OUT/test_multigpu.txt 2>&1
    echo "test_multigpu rc=$? t=$((SECONDS-S))"; tail -6 $OUT/test_multigpu.txt
    ;;
70b)
    timeout 560 python tools/multigpu_check.py --shape llama3-70b --format gptq --modes single tp \
        --work /tmp/k70 --out $OUT/mg > $OUT/mg.txt 2>&1
    echo "70b rc=$? t=$((SECONDS-S))"; tail -30 $OUT/mg.txt | grep -E "tok_s|identical|vs_single|load" | head -14
    ;;
*) echo "usage: next.sh tests|70b"; exit 2 ;;
esac
