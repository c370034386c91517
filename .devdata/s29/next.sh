#!/usr/bin/env bash
# Next GPU session's calls (issue 33), in order; each names its kind, carry and timeout.
#   1. bash .devdata/s29/next.sh tests (nvidia-h200-x2, carry .devdata/s11/w, timeout 300): the
#      whole multi-GPU file (the prompt-slice test's new count of deferred prompt sums has not
#      run on a GPU) and test_read_ahead's GPU case.
#   2. bash .devdata/s29/next.sh 70b (same warm machine, timeout 590): the 70B one GPU and
#      TP=2 at P512 and P2048 with the prompt sums inside the norms (P2048 was 1.78x before;
#      the profile after it 1.90x), greedy compared.
#   3. bash .devdata/s27/next.sh tp4 (nvidia-h200-x4, if lent): the 70B TP=4 critical path.
set -u
[ -d /tmp/site/llguidance ] || pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 KESTREL_TP_PEER_TIMEOUT_S=30
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$SECONDS
case "${1:-}" in
tests)
    timeout 280 python -m pytest -q -m gpu -p no:cacheprovider -rs tests/engine/test_multigpu.py \
        tests/engine/test_read_ahead.py > $OUT/tests.txt 2>&1
    echo "tests rc=$? t=$((SECONDS-S))"; tail -6 $OUT/tests.txt
    ;;
70b)
    for p in 512 2048; do
        timeout 270 python tools/multigpu_check.py --shape llama3-70b --format gptq \
            --modes single tp --prompt $p --work /tmp/k70 --out $OUT/mg$p > $OUT/mg$p.txt 2>&1
        echo "70b P$p rc=$? t=$((SECONDS-S))"
        grep -E '"(identical|decode_tok_s|prefill_tok_s)"' $OUT/mg$p/*summary.json | head -8
    done
    ;;
*) echo "usage: next.sh tests|70b"; exit 2 ;;
esac
