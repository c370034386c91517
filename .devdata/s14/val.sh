#!/usr/bin/env bash
# Session 14's first device call: validate wip/s13-merge (main + wip/s13-28: deterministic slot
# sums of issue 31 with the RMSNorm fold of issue 28) before it lands in main. Two GPUs:
#   GPU 0: the PDL test 20x per format, the GPU tests of the touched files (determinism in 3
#          fresh processes, slot sums, the fold's kernels and engine tests, gate_up SiLU),
#          tools/determinism_check on the 8B, compute-sanitizer synccheck + racecheck (cuDNN's
#          own kernels excluded: its SDPA prefill kernel reports hazards racecheck cannot model)
#   GPU 1: 8B GPTQ P512 decode A/B, main vs this tree, 3 interleaved rounds; kernels per step.
# Stage in /work/main (trees under .devdata/s14, git-ignored):
#   rm -rf .devdata/s14/{t,m}; mkdir -p .devdata/s14/{t,m}
#   git archive wip/s13-merge | tar -x -C .devdata/s14/t   # brings this script along
#   git archive main          | tar -x -C .devdata/s14/m
#   run(kind="nvidia-h200-x2" (H200 rows; an H100 pair is fine for the H100 rows),
#       carry=[".devdata/s14/t", ".devdata/s14/m", ".devdata/s11/w"], timeout_s=540,
#       command="bash .devdata/s14/t/.devdata/s14/val.sh")
# NEED_GPU=H200: run only on that card (else log it and stop). CHECKS_ONLY=1: GPU 0's checks alone.
# One GPU: ONE=1 ROUNDS=2 runs the A/B first, then GPU 0's checks, on the same card.
# Results: $OUT/val.log (summary), $OUT/val.tgz (everything).
set -u
R=$PWD; T=$R/.devdata/s14/t; M=$R/.devdata/s14/m; O=/tmp/val; mkdir -p $O/ab
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
LOG=$O/val.log; nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > $LOG
gpu0() {
  cd $T; export CUDA_VISIBLE_DEVICES=${G0:-0} PYTHONPATH=$T:/tmp/site; local S=$SECONDS
  timeout 200 python .devdata/s14/pdl20.py $O/pdl20.json > $O/pdl20.txt 2>&1
  echo "pdl20 rc=$? $(tr -d '\n' < $O/pdl20.json 2>/dev/null) t=$((SECONDS-S))" >> $LOG
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_determinism.py \
    tests/kernels/test_split_k_sums.py tests/kernels/test_norm_fold.py \
    tests/engine/test_norm_fold_engine.py tests/kernels/test_gate_up_silu.py \
    tests/kernels/test_programmatic_launch.py > $O/pytest_gpu.txt 2>&1
  echo "pytest gpu rc=$? $(tail -1 $O/pytest_gpu.txt) t=$((SECONDS-S))" >> $LOG
  timeout 60 python -m tools.determinism_check --shape llama3-8b --format gptq --work /tmp/kb0 \
    --runs 4 --steps 32 --prompt 64 --json $O/det8b.json > $O/det8b.txt 2>&1
  echo "determinism 8B rc=$? $(grep -h bit-identical $O/det8b.txt | tr '\n' ' ') t=$((SECONDS-S))" >> $LOG
  local CS; CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in synccheck racecheck; do
    timeout 100 "$CS" --tool $tool --print-limit 30 --kernel-name-exclude kns=cudnn python -m tools.determinism_check \
      --shape tiny --format gptq --runs 1 --steps 4 --pdl on --work /tmp/valw > $O/sanitizer-$tool.txt 2>&1
    echo "$tool rc=$? $(grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY' $O/sanitizer-$tool.txt | tail -1) t=$((SECONDS-S))" >> $LOG
  done
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=${G1:-1}; local S=$SECONDS
  for round in $(seq 1 ${ROUNDS:-3}); do
    for t in m t; do
      local tree=$R/.devdata/s14/$t
      (cd $tree && PYTHONPATH=$tree:/tmp/site timeout 90 python -m tools.bench --shape llama3-8b \
        --format gptq --prompts 512 --engines kestrel --work /tmp/kb1 --json $O/ab/bench-$t-$round.json \
        --plot /tmp/ab-$t-$round.png > /tmp/ab-$t-$round.log 2>&1)
      echo "ab $t round $round rc=$? $(grep -E '^kestrel' /tmp/ab-$t-$round.log) t=$((SECONDS-S))" >> $LOG
    done
  done
  (cd $T && PYTHONPATH=$T:/tmp/site timeout 45 python tools/profile_decode.py --shape llama3-8b \
     --format gptq --prompt 512 --work /tmp/kb1 --out $O/ab/prof > /tmp/prof.log 2>&1)
  echo "profile rc=$? $(grep -E 'kernels_per_step|graph_replay_ms' /tmp/prof.log | tr -s ' ' | tr '\n' ' ')" >> $LOG
}
if [ -n "${NEED_GPU:-}" ] && ! grep -q "$NEED_GPU" $LOG; then
  echo "not a $NEED_GPU: nothing run" >> $LOG  # ask again later; this call cost only its start
elif [ "${CHECKS_ONLY:-0}" = 1 ]; then  # the checks alone (GPU 0), no A/B
  gpu0
elif [ "${ONE:-0}" = 1 ]; then  # one GPU: the A/B first (nothing beside it), then the checks
  G0=0 G1=0; gpu1; gpu0
else
  gpu0 & A=$!
  gpu1 & B=$!
  wait $A $B
fi
cp $LOG $OUT/; tar -czf $OUT/val.tgz -C /tmp val
