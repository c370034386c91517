#!/usr/bin/env bash
# Next GPU session's calls (issues 28, 33), in order; each names its kind, carry and timeout.
#   1. bash .devdata/s27/argmax.sh  (nvidia-h200, carry .devdata/s11/w, timeout 300):
#      the argmax kernels' GPU tests (incl. 2^31 rows) and the 8B decode against this
#      session's 466.3 / 483.3 tok/s (sync / scheduler) with torch's argmax; EXL2, 4-bit head.
#   2. bash .devdata/s25/v28.sh 8b then 70b (same warm machine): issue 28's table with exllamav2.
#   3. bash .devdata/s27/next.sh tp4  (nvidia-h200-x4, carry .devdata/s11/w, timeout 595): the
#      70B TP=4 critical path (80 layers), for issue 33's 2.4x gap.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/next-${1:-}.log; S=$SECONDS
case "${1:-}" in
tp4)
    timeout 200 python tools/multigpu_check.py --shape llama3-70b --format gptq --modes tp4 \
        --work /tmp/k70 --out $OUT/mg > /tmp/mg.txt 2>&1
    echo "70b tp4 rc=$? t=$((SECONDS-S))" >> $L
    mkdir -p /tmp/kp && ln -sfn /tmp/k70/llama3-70b-gptq /tmp/kp/llama3-70b-L80-gptq
    timeout 200 python tools/profile_tp_decode.py --shape llama3-70b --layers 80 --modes tp4 \
        --prompt 512 --steps 24 --work /tmp/kp --out /tmp/prof > /tmp/prof.txt 2>&1
    echo "profile tp4 rc=$? t=$((SECONDS-S))" >> $L; grep -v Warn /tmp/prof.txt | tail -16 >> $L
    python tools/critical_path.py /tmp/prof/tp_profile-llama3-70b-L80-tp4.trace.json --by-grid \
        --top 30 --json $OUT/cp-70b-tp4.json >> $L 2>&1
    ;;
*) echo "usage: next.sh tp4"; exit 2 ;;
esac
cat $L
