#!/usr/bin/env bash
# Session 28, issue 28: critical paths for the table's rows that had none (kind nvidia-h200,
# carry .devdata/s11/w, timeout 420): the 70B shape on one GPU (20 of its 80 layers: per layer
# it is the 70B model) at P512, and the 8B at P8192; tools/critical_path.py --by-grid on each.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
S=$SECONDS
run() {  # name shape layers prompt
    timeout $((400-(SECONDS-S))) python tools/profile_tp_decode.py --shape $2 --layers $3 \
        --format gptq --modes single --prompt $4 --steps 32 --work /tmp/kp --out /tmp/prof-$1 \
        > $OUT/prof-$1.txt 2>&1
    echo "$1 rc=$? t=$((SECONDS-S))"
    cp /tmp/prof-$1/*-single.json $OUT/prof-$1.json 2>/dev/null
    python tools/critical_path.py /tmp/prof-$1/*-single.trace.json --by-grid --top 40 \
        --json $OUT/cp-$1.json > $OUT/cp-$1.txt 2>&1
    head -45 $OUT/cp-$1.txt
}
run 8b-p8192 llama3-8b 32 8192
run 70b-p512 llama3-70b 20 512
