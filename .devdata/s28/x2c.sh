#!/usr/bin/env bash
# Session 28, issue 33 (kind nvidia-h200-x2, carry .devdata/s11/w, timeout 240): the 8B TP=2
# scheduler decode's traces (rank 0, CPU and GPU events) brought back gzipped, to read on the
# CPU why a TP step leaves the GPU idle ~106 us (memcpy32_post charged 24.6 us, 3 a step) where
# one GPU's idles ~31; and one GPU's trace for comparison.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$SECONDS
timeout 200 python tools/profile_tp_decode.py --shape llama3-8b --layers 32 \
    --modes tp single --prompt 512 --steps 24 --work /tmp/kp --out /tmp/prof > $OUT/prof.txt 2>&1
echo "profile rc=$? t=$((SECONDS-S))"
for m in tp single; do
    gzip -c /tmp/prof/tp_profile-llama3-8b-L32-$m.trace.json > $OUT/trace-$m.json.gz
done
ls -la $OUT; grep -E "tok/s|idle" $OUT/prof.txt
