#!/usr/bin/env bash
# Issue 29, session 24, CPU: does the shrinkage hold on Gemma-3-270M? One measurement on
# the shared English text with --shrink 0, then the quantizing pass at 4.0 bpw with
# --shrink 0 and 0.3 (with -m it applies to that pass only), perplexity 16 windows.
set -u
cd /work/main
M=/work/models/gemma-3-270m-fp16
D=/tmp/d29/s24/gemma; mkdir -p $D
S=$SECONDS
.venv/bin/python convert.py -i $M -o $D/unused -b 4.0 -c /tmp/d29/shared.txt --device cpu \
    --shrink 0 -om $D/meas.json > $D/meas.log 2>&1
echo "measure rc=$? $((SECONDS-S)) s" >> $D/progress.txt
for l in 0 0.3; do
  .venv/bin/python convert.py -i $M -o $D/g4-$l -b 4.0 -c /tmp/d29/shared.txt --device cpu \
      --shrink $l -m $D/meas.json > $D/g4-$l.log 2>&1
  echo "quantize $l rc=$? $((SECONDS-S)) s" >> $D/progress.txt
done
.venv/bin/python tools/perplexity.py -m $D/g4-0 $D/g4-0.3 --domains --windows 16 --device cpu \
    > $D/ppl.log 2>&1
echo "ppl rc=$? $((SECONDS-S)) s" >> $D/progress.txt
