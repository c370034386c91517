#!/usr/bin/env bash
# Issue 29, session 24, CPU: Hessian shrinkage toward the diagonal (shrink.py) at several
# strengths, then perplexity per domain (16 windows) with session 23's control (floor-0:
# the unchanged quantizer) and the mix-calibrated GPTQ pass (t2) beside them. SmolLM2-135M,
# 4.0 bpw, the shared measurement and the shared English calibration text (/tmp/d29).
set -u
cd /work/main
M=/work/models/SmolLM2-135M-Instruct-fp16
D=/tmp/d29/s24; mkdir -p $D
S=$SECONDS
for l in ${LAMBDAS:-0.1 0.3 1.0}; do
  .venv/bin/python .devdata/s24/shrink.py $l ${SCOPE:-all} -- -i $M -o $D/shrink-${SCOPE:-all}-$l -b 4.0 \
      -m /tmp/d29/meas.json -c /tmp/d29/shared.txt --device cpu > $D/shrink-$l.log 2>&1
  echo "shrink $l rc=$? $((SECONDS-S)) s" >> $D/progress.txt
done
.venv/bin/python tools/perplexity.py -m ${EXTRA:-} $(for l in ${LAMBDAS:-0.1 0.3 1.0}; do echo $D/shrink-${SCOPE:-all}-$l; done) \
    --domains --windows ${WINDOWS:-16} --device cpu > $D/ppl-shrink-${SCOPE:-all}.log 2>&1
echo "ppl rc=$? $((SECONDS-S)) s" >> $D/progress.txt
