#!/usr/bin/env bash
# Issue 29, session 24, CPU: Hessian shrinkage 0.3 (shrink.py) against the unchanged
# quantizer (0) at 3.0 bpw on the shared text and at 4.0 on the shipped mix (the converter's
# own default), each with its saved measurement (/tmp/d29/meas.json, meas-mix.json), then
# perplexity per domain, 16 windows.
set -u
cd /work/main
M=/work/models/SmolLM2-135M-Instruct-fp16
D=/tmp/d29/s24; mkdir -p $D
S=$SECONDS
for l in 0 0.3; do
  .venv/bin/python .devdata/s24/shrink.py $l all -- -i $M -o $D/sh3-$l -b 3.0 \
      -m /tmp/d29/meas.json -c /tmp/d29/shared.txt --device cpu > $D/sh3-$l.log 2>&1
  echo "sh3 $l rc=$? $((SECONDS-S)) s" >> $D/progress2.txt
  .venv/bin/python .devdata/s24/shrink.py $l all -- -i $M -o $D/mix4-$l -b 4.0 \
      -m /tmp/d29/meas-mix.json --device cpu > $D/mix4-$l.log 2>&1
  echo "mix4 $l rc=$? $((SECONDS-S)) s" >> $D/progress2.txt
done
.venv/bin/python tools/perplexity.py -m $D/sh3-0 $D/sh3-0.3 $D/mix4-0 $D/mix4-0.3 \
    --domains --windows 16 --device cpu > $D/ppl-shrink2.log 2>&1
echo "ppl rc=$? $((SECONDS-S)) s" >> $D/progress2.txt
