#!/usr/bin/env bash
# Issue 29, session 23, CPU: the Hessian floor (hprior.py) at several strengths, then
# perplexity per domain (8 windows) of every result. SmolLM2-135M, 4.0 bpw, the shared
# measurement and the shared (English) calibration text of sessions 21-22 (/tmp/d29).
set -u
cd /work/main
M=/work/models/SmolLM2-135M-Instruct-fp16
D=/tmp/d29/s23; mkdir -p $D
S=$SECONDS
for f in ${FLOORS:-0 0.05 0.2}; do
  .venv/bin/python .devdata/s23/hprior.py $f -- -i $M -o $D/floor-$f -b 4.0 -m /tmp/d29/meas.json \
      -c /tmp/d29/shared.txt --device cpu > $D/floor-$f.log 2>&1
  echo "floor $f rc=$? $((SECONDS-S)) s" >> $D/progress.txt
done
.venv/bin/python tools/perplexity.py -m $(for f in ${FLOORS:-0 0.05 0.2}; do echo $D/floor-$f; done) \
    --domains --windows 8 --device cpu > $D/ppl.log 2>&1
echo "ppl rc=$? $((SECONDS-S)) s" >> $D/progress.txt
