#!/usr/bin/env bash
# Issue 29, session 25, CPU: SmolLM2-135M 4.0 bpw on the shared text (CPU rows), the
# quantizing pass with --shrink auto (what it picks at CPU rows) and fixed 0.5 and 1.0
# (does multilingual keep improving past 0.3?), measurement /tmp/d29/meas.json (at 0).
set -u
cd /work/main
M=/work/models/SmolLM2-135M-Instruct-fp16
D=/tmp/d29/s25; mkdir -p $D
S=$SECONDS
for l in auto 0.5 1; do
  .venv/bin/python convert.py -i $M -o $D/s4-$l -b 4.0 -c /tmp/d29/shared.txt --device cpu \
      --shrink $l -m /tmp/d29/meas.json > $D/s4-$l.log 2>&1
  echo "quantize $l rc=$? $((SECONDS-S)) s" >> $D/progress.txt
done
.venv/bin/python tools/perplexity.py -m $D/s4-auto $D/s4-0.5 $D/s4-1 --domains --windows 16 --device cpu \
    > $D/ppl.log 2>&1
echo "ppl rc=$? $((SECONDS-S)) s" >> $D/progress.txt
