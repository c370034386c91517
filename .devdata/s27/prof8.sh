#!/usr/bin/env bash
# Session 27, issue 28: where one GPU's 8B decode step goes now (kind nvidia-h200, carry
# .devdata/s11/w, timeout 200): tools/profile_tp_decode.py --modes single, all 32 layers, GPTQ
# then EXL2, and tools/critical_path.py --by-grid on each trace.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
S=$SECONDS
for f in gptq exl2; do
    [ $((SECONDS-S)) -gt 120 ] && break
    timeout $((190-(SECONDS-S))) python tools/profile_tp_decode.py --shape llama3-8b --layers 32 \
        --format $f --modes single --prompt 512 --steps 32 --work /tmp/kp --out /tmp/prof-$f \
        > $OUT/prof-$f.txt 2>&1
    echo "$f rc=$? t=$((SECONDS-S))"
    cp /tmp/prof-$f/*-single.json $OUT/prof-$f.json 2>/dev/null
    python tools/critical_path.py /tmp/prof-$f/*-single.trace.json --by-grid --top 40 \
        --json $OUT/cp-$f.json > $OUT/cp-$f.txt 2>&1
    head -60 $OUT/cp-$f.txt
done
