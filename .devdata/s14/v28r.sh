#!/usr/bin/env bash
# Session 14, last device call (one GPU, kind nvidia-h200: an H100 usually comes).
#   On an H200: issue 31's checks on main (val.sh CHECKS_ONLY: PDL test 20x per format, the
#               GPU tests incl. the 3-process determinism test, 8B determinism, sanitizers).
#   On an H100: wip/s14-28 (RoPE + cache write in qkv's slot sum): its GPU tests, the
#               determinism test, then 8B GPTQ P512 decode A/B against main, 2 interleaved
#               rounds, and kernels per step.
# Stage in /work/main: .devdata/s14/t = git archive main (with val.sh), .devdata/s14/r =
# git archive wip/s14-28; carry .devdata/s14/t, .devdata/s14/r, .devdata/s11/w.
set -u
R=$PWD; O=/tmp/v28r; mkdir -p $O/ab; LOG=$O/v28r.log
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > $LOG
if grep -q H200 $LOG; then
  echo "H200: issue 31's checks on main" >> $LOG
  NEED_GPU=H200 CHECKS_ONLY=1 OUT=$O bash .devdata/s14/t/.devdata/s14/val.sh
  cat $O/val.log >> $LOG
else
  export CUDA_VISIBLE_DEVICES=0; S=$SECONDS
  (cd .devdata/s14/r && PYTHONPATH=$PWD:/tmp/site timeout 240 python -m pytest -q -m gpu \
     -p no:cacheprovider tests/kernels/test_slot_sum_rope.py tests/engine/test_norm_fold_engine.py \
     tests/engine/test_determinism.py > $O/pytest_gpu.txt 2>&1)
  echo "pytest gpu rc=$? $(tail -1 $O/pytest_gpu.txt) t=$((SECONDS-S))" >> $LOG
  for round in 1 2; do
    for t in t r; do
      tree=$R/.devdata/s14/$t
      (cd $tree && PYTHONPATH=$tree:/tmp/site timeout 90 python -m tools.bench --shape llama3-8b \
        --format gptq --prompts 512 --engines kestrel --work /tmp/kb1 --json $O/ab/bench-$t-$round.json \
        --plot /tmp/ab-$t-$round.png > /tmp/ab-$t-$round.log 2>&1)
      echo "ab $t round $round rc=$? $(grep -E '^kestrel' /tmp/ab-$t-$round.log) t=$((SECONDS-S))" >> $LOG
    done
  done
  (cd .devdata/s14/r && PYTHONPATH=$PWD:/tmp/site timeout 45 python tools/profile_decode.py --shape llama3-8b \
     --format gptq --prompt 512 --work /tmp/kb1 --out $O/ab/prof > /tmp/prof.log 2>&1)
  echo "profile rc=$? $(grep -E 'kernels_per_step|graph_replay_ms' /tmp/prof.log | tr -s ' ' | tr '\n' ' ') t=$((SECONDS-S))" >> $LOG
fi
cp $LOG $OUT/; tar -czf $OUT/v28r.tgz -C /tmp v28r
