#!/usr/bin/env bash
# Session 28, issue 33 (kind nvidia-h200-x2, carry .devdata/s11/w, timeout 500): prefill-sized
# all-reduces (NCCL default / Simple / LL128, torch symm-mem one- and two-shot), then the 8B
# TP=2 prefill under NCCL_PROTO=Simple against default, then the 8B TP=2 decode critical path
# (critical_path.py now marks steps at kernels/argmax.py's row kernel).
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$SECONDS; mkdir -p $OUT/ar
for p in default Simple LL128; do
    if [ $p = default ]; then unset NCCL_PROTO; else export NCCL_PROTO=$p; fi
    timeout 90 python .devdata/s28/ar_probe.py $OUT/ar/ar-$p.json > /tmp/ar-$p.txt 2>&1
    echo "ar $p rc=$? t=$((SECONDS-S))"; tail -c 1500 /tmp/ar-$p.txt | tail -3
done
unset NCCL_PROTO
for p in default Simple; do
    if [ $p = default ]; then unset NCCL_PROTO; else export NCCL_PROTO=$p; fi
    timeout $((330-(SECONDS-S))) python tools/profile_prefill.py --shape llama3-8b --mode tp \
        --prompts 512 2048 --out /tmp/pf-$p > /tmp/pf-$p.log 2>&1
    echo "tp prefill $p rc=$? t=$((SECONDS-S))"; grep prefill_tok_s /tmp/pf-$p.log | cut -c1-120
    cp /tmp/pf-$p/prefill-tp.json $OUT/ar/prefill-tp-$p.json 2>/dev/null
done
unset NCCL_PROTO
timeout $((480-(SECONDS-S))) python tools/profile_tp_decode.py --shape llama3-8b --layers 32 \
    --modes tp --prompt 512 --steps 32 --work /tmp/kp --out /tmp/prof > $OUT/prof-tp.txt 2>&1
echo "tp decode profile rc=$? t=$((SECONDS-S))"
python tools/critical_path.py /tmp/prof/*-tp.trace.json --by-grid --top 40 \
    --json $OUT/cp-8b-tp.json > $OUT/cp-8b-tp.txt 2>&1
head -30 $OUT/cp-8b-tp.txt
