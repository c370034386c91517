#!/usr/bin/env bash
# Session 28 (kind nvidia-h200-x2, carry .devdata/s11/w, timeout 560):
#  1. issue 28: bench.py 8B GPTQ P512, Kestrel only: the scheduler's greedy job (ban_eos_token,
#     so sample_batched) now takes kernels/argmax.py; compare 482.5-485.4 scheduler tok/s.
#  2. issue 33: 8B prefill profiles, one GPU and TP=2 (tools/profile_prefill.py --mode), P512
#     and P2048, for TP prefill's 1.41x against 1.5x.
#  3. issue 33: 8B TP=2 decode critical path (tools/profile_tp_decode.py --modes tp).
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$SECONDS
nvidia-smi topo -m > $OUT/topo.txt 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 120 python tools/bench.py --shape llama3-8b --format gptq --prompts 512 \
    --engines kestrel --json $OUT/bench-8b.json > $OUT/bench.txt 2>&1
echo "bench rc=$? t=$((SECONDS-S))"; tail -2 $OUT/bench.txt
mkdir -p $OUT/pf
for m in single tp; do
    timeout $((420-(SECONDS-S))) python tools/profile_prefill.py --shape llama3-8b --mode $m \
        --prompts 512 2048 --out /tmp/pf > $OUT/pf/prefill-$m.log 2>&1
    echo "prefill $m rc=$? t=$((SECONDS-S))"; grep prefill_tok_s $OUT/pf/prefill-$m.log
done
cp /tmp/pf/prefill*.json $OUT/pf/ 2>/dev/null
timeout $((550-(SECONDS-S))) python tools/profile_tp_decode.py --shape llama3-8b --layers 32 \
    --modes tp --prompt 512 --steps 32 --work /tmp/kp --out /tmp/prof > $OUT/prof-tp.txt 2>&1
echo "tp decode profile rc=$? t=$((SECONDS-S))"
python tools/critical_path.py /tmp/prof/*-tp.trace.json --by-grid --top 40 \
    --json $OUT/cp-8b-tp.json > $OUT/cp-8b-tp.txt 2>&1
head -40 $OUT/cp-8b-tp.txt
