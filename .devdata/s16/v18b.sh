#!/usr/bin/env bash
# Session 17, issue 33: branch wip/s16-33f on GPUs (kind nvidia-h100-x2 or any 2+ GPU kind;
# timeout 590). The branch (CPU-tested only):
#   - bounds the all-reduce kernels' waits on a peer (%globaltimer; trap with one message per
#     program after KESTREL_TP_PEER_TIMEOUT_S, default 120 s),
#   - makes the ranks vote after each set-up step (GroupAllReduce, SiteAllReduce.build),
#   - adds KESTREL_TP_SITE_KERNEL=slots (kernels/tp_push_from_slots.py: the push straight from
#     the GEMV's split-K slots, 512 columns a program, the row's last program finishing the norm).
# Steps: 1. the timeout GPU test (late flag, never flag) + the agreement test; 2. test_multigpu.py
# whole with push and with slots; 3. check_tp_all_reduce push (per-call time with the timer read;
# 2xH200 without it, s16: 3.08 / 3.78 us); 4. 8B GPTQ single, TP=2 push, TP=2 slots (one process
# each, one results folder: greedy compared with single).
# Stage in /work/main: rm -rf .devdata/s16/b; mkdir -p .devdata/s16/b;
#   git archive wip/s16-33f | tar -x -C .devdata/s16/b
# carry .devdata/s16/b, .devdata/s11/w.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/v18b.log; S=$SECONDS
nvidia-smi --query-gpu=index,name --format=csv,noheader > $L
cd .devdata/s16/b && export PYTHONPATH=$PWD:/tmp/site
timeout 120 python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/kernels/test_tp_peer_timeout.py \
  tests/engine/test_tensor_parallel_site_agreement.py > $OUT/pytest_timeout.txt 2>&1
echo "timeout+agreement tests rc=$? $(tail -1 $OUT/pytest_timeout.txt) t=$((SECONDS-S))" >> $L
for k in push slots; do
  KESTREL_TP_SITE_KERNEL=$k timeout 150 python -m pytest -q -m gpu -p no:cacheprovider \
    tests/engine/test_multigpu.py > $OUT/pytest_multigpu_$k.txt 2>&1
  echo "test_multigpu $k rc=$? $(tail -1 $OUT/pytest_multigpu_$k.txt) t=$((SECONDS-S))" >> $L
done
timeout 60 python tools/check_tp_all_reduce.py --kernel push --out $OUT > $OUT/check-push.txt 2>&1
echo "check push rc=$? $(grep -h '"ok"\|site_sum' $OUT/check_tp_all_reduce-push.json | tr -d '\n ') t=$((SECONDS-S))" >> $L
timeout 70 python tools/multigpu_check.py --shape llama3-8b --format gptq --modes single \
  --work /tmp/kmg --out $OUT/mg > $OUT/mg-single.txt 2>&1
echo "8b single rc=$? t=$((SECONDS-S))" >> $L
for k in push slots; do
  KESTREL_TP_SITE_KERNEL=$k timeout 70 python tools/multigpu_check.py --shape llama3-8b --format gptq \
    --modes tp --work /tmp/kmg --out $OUT/mg > $OUT/mg-$k.txt 2>&1
  echo "8b tp $k rc=$? $(grep -o '"decode_tok_s": [0-9.]*' $OUT/mg-$k.txt | head -1) $(grep -A3 '"tp": {' $OUT/mg-$k.txt | grep identical | head -1) t=$((SECONDS-S))" >> $L
done
grep -o '"decode_tok_s": [0-9.]*' $OUT/mg-single.txt | head -1 >> $L
cat $L
