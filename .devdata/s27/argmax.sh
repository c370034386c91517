#!/usr/bin/env bash
# Session 27, issue 28: the two-kernel argmax (kernels/argmax.py) on a GPU: its GPU test, then
# the 8B GPTQ decode (bench.py P512, Kestrel only) to compare with this session's 466.3 / 483.3
# tok/s (sync / scheduler), then EXL2 with a 4-bit head (issue 28's "EXL2 within 5% of GPTQ at
# the same bits": the bench's EXL2 head is 6-bit, GPTQ's 4). kind nvidia-h200, carry
# .devdata/s11/w, timeout 300.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
S=$SECONDS
timeout 90 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_argmax.py > $OUT/pytest.txt 2>&1
echo "argmax gpu test rc=$? $(tail -1 $OUT/pytest.txt) t=$((SECONDS-S))"
timeout $((190-(SECONDS-S))) python tools/bench.py --shape llama3-8b --format gptq --prompts 512 \
    --engines kestrel --json $OUT/bench-8b.json > $OUT/bench.txt 2>&1
echo "bench rc=$? t=$((SECONDS-S))"; tail -3 $OUT/bench.txt
timeout $((290-(SECONDS-S))) python tools/bench.py --shape llama3-8b --format exl2 --exl2-head-bits 4 \
    --prompts 512 --engines kestrel --json $OUT/bench-8b-exl2-head4.json > $OUT/bench-exl2h4.txt 2>&1
echo "bench exl2 head4 rc=$? t=$((SECONDS-S))"; tail -3 $OUT/bench-exl2h4.txt
