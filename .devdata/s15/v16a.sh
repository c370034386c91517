#!/usr/bin/env bash
# Session 16, issue 28 (one GPU, kind nvidia-h200; an H100 may come instead).
#   Both cards: the GPU tests of main (.devdata/s14/t) and of wip/s15-28d (.devdata/s14/r:
#               decode attention reads the first block's old keys/values before its PDL
#               wait), then 8B GPTQ P512 decode A/B t vs r, 2 interleaved rounds, and the
#               step's graph replay time of r. The PDL and determinism tests are the race
#               checks of r's early reads.
#   On an H200 first: issue 31's checks on t (val.sh CHECKS_ONLY: PDL test 20x per format, GPU
#               tests incl. the 3-process determinism test, 8B determinism, both sanitizers).
# Stage in /work/main: rm -rf .devdata/s14/{t,r}; mkdir -p .devdata/s14/{t,r};
#   git archive main | tar -x -C .devdata/s14/t; git archive wip/s15-28d | tar -x -C .devdata/s14/r
# carry .devdata/s14/t, .devdata/s14/r, .devdata/s11/w.
set -u
R=$PWD; O=/tmp/v16a; mkdir -p $O/ab; LOG=$O/v16a.log
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > $LOG
export CUDA_VISIBLE_DEVICES=0; S=$SECONDS; TREES="t r" ROUNDS="1 2"
if [ "${RUN31:-0}" = 1 ] && grep -q H200 $LOG; then
  echo "H200: issue 31's checks on t" >> $LOG
  NEED_GPU=H200 CHECKS_ONLY=1 OUT=$O bash .devdata/s14/t/.devdata/s14/val.sh
  cat $O/val.log >> $LOG
  TREES="r" ROUNDS="1"  # val.sh ran t's GPU tests; keep the call under its 600 s
fi
GPU_TESTS="tests/kernels/test_norm_fold.py tests/engine/test_norm_fold_engine.py
  tests/kernels/test_split_k_sums.py tests/kernels/test_programmatic_launch.py
  tests/kernels/test_slot_sum_rope.py tests/kernels/test_gate_up_silu.py tests/engine/test_determinism.py
  tests/kernels/test_kernel_paged_attention.py tests/kernels/test_kv_cache_types.py"
for t in $TREES; do
  (cd .devdata/s14/$t && PYTHONPATH=$PWD:/tmp/site timeout 200 python -m pytest -q -m gpu \
     -p no:cacheprovider $GPU_TESTS > $O/pytest_gpu_$t.txt 2>&1)
  echo "pytest gpu $t rc=$? $(tail -1 $O/pytest_gpu_$t.txt) t=$((SECONDS-S))" >> $LOG
done
# The race check of r's early reads: the PDL test 20 times per format (tokens with PDL = without).
(cd .devdata/s14/r && PYTHONPATH=$PWD:/tmp/site timeout 200 python .devdata/s14/pdl20.py $O/pdl20-r.json > $O/pdl20-r.txt 2>&1)
echo "pdl20 r rc=$? $(tr -d '\n' < $O/pdl20-r.json 2>/dev/null) t=$((SECONDS-S))" >> $LOG
for round in $ROUNDS; do
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
echo "profile r rc=$? $(grep -E 'kernels_per_step|graph_replay_ms' /tmp/prof.log | tr -s ' ' | tr '\n' ' ') t=$((SECONDS-S))" >> $LOG
(cd .devdata/s14/t && PYTHONPATH=$PWD:/tmp/site timeout 45 python tools/profile_decode.py --shape llama3-8b \
   --format gptq --prompt 512 --work /tmp/kb1 --out $O/ab/prof-t > /tmp/prof-t.log 2>&1)
echo "profile t rc=$? $(grep -E 'kernels_per_step|graph_replay_ms' /tmp/prof-t.log | tr -s ' ' | tr '\n' ' ') t=$((SECONDS-S))" >> $LOG
cp $LOG $OUT/; tar -czf $OUT/v16a.tgz -C /tmp v16a
