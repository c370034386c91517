#!/usr/bin/env bash
# Session 28, issue 33 (kind nvidia-h200-x2, carry .devdata/s11/w, timeout 420): prompt rows'
# all-reduce on the flags kernel over two float16 slices (site_reduce.build_prompt) in place
# of NCCL: the multi-GPU tests (a 200-token prompt through the slices among them), the 8B
# TP=2 prefill profile (before: 13.08 / 33.7 ms at P512 / P2048), multigpu_check 8B.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 KESTREL_TP_PEER_TIMEOUT_S=30
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$SECONDS
timeout 170 python -m pytest -q -x -m gpu -p no:cacheprovider tests/engine/test_multigpu.py \
    -k "tensor_parallel" > $OUT/test_multigpu.txt 2>&1
echo "test_multigpu tp rc=$? t=$((SECONDS-S))"; tail -3 $OUT/test_multigpu.txt
timeout $((260-(SECONDS-S))) python tools/profile_prefill.py --shape llama3-8b --mode tp \
    --prompts 512 2048 --out /tmp/pf > $OUT/prefill-tp.log 2>&1
echo "prefill tp rc=$? t=$((SECONDS-S))"; grep prefill_tok_s $OUT/prefill-tp.log | cut -c1-110
cp /tmp/pf/prefill-tp.json $OUT/ 2>/dev/null
grep -E "AllReduce|_tp_all_reduce|ncclDev" $OUT/prefill-tp.log | head -6
timeout $((400-(SECONDS-S))) python tools/multigpu_check.py --shape llama3-8b --format gptq \
    --modes single tp --work /tmp/kp8 --out $OUT/mg > $OUT/mg.txt 2>&1
echo "multigpu_check 8b rc=$? t=$((SECONDS-S))"; tail -25 $OUT/mg.txt | grep -E "tok_s|identical|vs_single|prefill" | head -12
