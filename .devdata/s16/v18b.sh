#!/usr/bin/env bash
# Session 17, issue 33: wip/s16-33 on GPUs (kind nvidia-h100-x2 or any 2+ GPU kind; timeout 420).
# The branch bounds the all-reduce kernels' waits on a peer (%globaltimer, trap with a message
# after PEER_TIMEOUT_S) and makes SiteAllReduce.build's ranks agree after each set-up step.
#   1. tests/kernels/test_tp_peer_timeout.py on a GPU (the trap ends a child process with the
#      message; a flag that comes still returns), 2. test_multigpu.py whole file (push default),
#   3. check_tp_all_reduce --kernel push flags: bits, and the per-call time with the timer read
#      in the poll loop (2xH200 without it, session 16: push 3.08 / 3.78 us).
# Stage in /work/main: rm -rf .devdata/s16/b; mkdir -p .devdata/s16/b;
#   git archive wip/s16-33 | tar -x -C .devdata/s16/b
# carry .devdata/s16/b, .devdata/s11/w.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/v18b.log; S=$SECONDS
nvidia-smi --query-gpu=index,name --format=csv,noheader > $L
cd .devdata/s16/b && export PYTHONPATH=$PWD:/tmp/site
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_tp_peer_timeout.py \
  tests/engine/test_tensor_parallel_site_agreement.py > $OUT/pytest_timeout.txt 2>&1
echo "timeout tests rc=$? $(tail -1 $OUT/pytest_timeout.txt) t=$((SECONDS-S))" >> $L
timeout 170 python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_multigpu.py \
  > $OUT/pytest_multigpu.txt 2>&1
echo "test_multigpu rc=$? $(tail -1 $OUT/pytest_multigpu.txt) t=$((SECONDS-S))" >> $L
for k in push flags; do
  timeout 60 python tools/check_tp_all_reduce.py --kernel $k --out $OUT > $OUT/check-$k.txt 2>&1
  echo "check $k rc=$? $(grep -h '"ok"\|site_sum' $OUT/check_tp_all_reduce-$k.json | tr -d '\n ') t=$((SECONDS-S))" >> $L
done
cat $L
