#!/usr/bin/env bash
# Issue 29, session 25, CPU: --shrink auto with the parabola refinement, SmolLM2 4.0 shared.
set -u
cd /work/main
M=/work/models/SmolLM2-135M-Instruct-fp16
D=/tmp/d29/s25; S=$SECONDS
.venv/bin/python convert.py -i $M -o $D/s4-refined -b 4.0 -c /tmp/d29/shared.txt --device cpu \
    -m /tmp/d29/meas.json > $D/s4-refined.log 2>&1
echo "quantize refined rc=$? $((SECONDS-S)) s" >> $D/progress.txt
.venv/bin/python tools/perplexity.py -m $D/s4-refined --domains --windows 16 --device cpu \
    > $D/ppl-refined.log 2>&1
echo "ppl refined rc=$? $((SECONDS-S)) s" >> $D/progress.txt
