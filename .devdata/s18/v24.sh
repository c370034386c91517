#!/usr/bin/env bash
# Session 19+: issue 29 on a GPU now that a Gemma GGUF's tokenizer is Kestrel's own (s18 found
# the device's transformers 5.17 built a Unigram one: every Gemma GPU figure before was void).
# After the five carry calls of .devdata/s16/q29.sh (gemma c0..c4), on the same warm machine:
#   call A: bash .devdata/s18/v24.sh stage  (carry .devdata/s11/w .devdata/s14/d/small; ~3 min)
#   call B: bash .devdata/s18/v24.sh gemma  (no carry): the dtype check with warmed-up decode
#           speed, then the converter comparison at 4.0 and 3.0 with each one's defaults.
#   call C: bash .devdata/s16/q29.sh run gemma  (the full comparison, shared calibration too)
set -u
case "${1:-}" in
stage)
    bash .devdata/s16/q29.sh stage
    python - <<'PY'
import json, glob
from tokenizers import Tokenizer
d = glob.glob("/tmp/q29/models/gemma-3-270m*")[0]
t = Tokenizer.from_file(d + "/tokenizer.json")
print("tokenizer", json.load(open(d + "/tokenizer.json"))["model"]["type"], t.encode("The capital of France").ids)
PY
    ;;
gemma)
    export PYTHONPATH=$PWD:/tmp/q29/site
    M=$(ls -d /tmp/q29/models/gemma-3-270m* | head -1)
    timeout 200 python .devdata/s17/gemma_gpu.py $M /tmp/q29/wiki.utf8 $OUT/gemma_gpu.json \
        > $OUT/gemma_gpu.txt 2>&1; echo "gemma_gpu rc=$?"; tail -12 $OUT/gemma_gpu.txt
    timeout 360 python tools/compare_converters.py --model $M --exllamav2-bits 4 3 --kestrel-bits 4 3 \
        --calibrations default --windows 20 --device cuda:0 --work /tmp/q29/work-gemma \
        --json $OUT/q29-gemma.json > $OUT/q29-gemma.txt 2>&1; echo "compare rc=$?"; tail -12 $OUT/q29-gemma.txt
    ;;
*) echo "usage: v24.sh stage | gemma"; exit 2 ;;
esac
