#!/usr/bin/env bash
# Session 29 (issue 33): prompt rows' deferred sums (summed inside the next norm, as decode
# rows are). nvidia-h200-x2, carry .devdata/s11/w, timeout 280: the TP prompt-slice and
# quantized-cache GPU tests; the 8B one GPU against TP=2 (greedy, prefill); if time is left,
# the 70B TP=2 prefill profile at P2048 (before: 276.6 ms; rms_norm 60.6 us a call against
# one GPU's 32.5, the all-reduce 118.9 us).
set -u
[ -d /tmp/site/llguidance ] || pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 KESTREL_TP_PEER_TIMEOUT_S=30
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$SECONDS
timeout 90 python -m pytest -q -m gpu -p no:cacheprovider -rs tests/engine/test_multigpu.py \
    -k "prompt_slices or quantized_cache" > $OUT/tests.txt 2>&1
echo "tests rc=$? t=$((SECONDS-S))"; tail -3 $OUT/tests.txt
timeout $((200-(SECONDS-S))) python tools/multigpu_check.py --shape llama3-8b --format gptq \
    --modes single tp --work /tmp/kp8 --out $OUT/mg > $OUT/mg.txt 2>&1
echo "8b rc=$? t=$((SECONDS-S))"; grep -E '"(identical|prefill_tok_s|decode_tok_s)"' $OUT/mg/*summary.json | head -8
if [ $((SECONDS-S)) -lt 150 ]; then
    timeout $((265-(SECONDS-S))) python tools/profile_prefill.py --shape llama3-70b --mode tp \
        --prompts 2048 --work /tmp/k70 --out $OUT/pf > $OUT/prefill70-tp.log 2>&1
    echo "70b profile rc=$? t=$((SECONDS-S))"
    python -c "
import json; d=json.load(open('$OUT/pf/prefill-tp.json'))
for p in d['prompts']:
    print(p['prompt'], round(p['prefill_ms'],2))
    for k in p['kernels'][:8]: print('  ', k['name'][:60], round(k['us']/1e3,2), int(k['count']))
" 2>&1 | head -12
fi
