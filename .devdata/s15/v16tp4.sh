#!/usr/bin/env bash
# Session 16, issue 33's TP=4 profile (kind nvidia-h100-x4), run in the repository root,
# carry [".devdata/s11/w"], timeout 420. The 70B shape with 8 layers (per layer it is the
# 70B): one GPU, TP=2 and TP=4 with the push all-reduce, then TP=2 and TP=4 with the flag
# kernel; each rank-0 trace through tools/critical_path.py. ~5 modes x 35-50 s.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:/tmp/site
L=$OUT/v16tp4.log; S=$SECONDS
nvidia-smi --query-gpu=index,name --format=csv,noheader > $L
# One process per mode: a process sets up symmetric memory once, so a second TP load in the
# same process would fall back to NCCL's all-reduce (README, not supported yet).
run() {  # kernel, mode
  local k=$1 m=$2
  KESTREL_TP_SITE_KERNEL=$k timeout 120 python tools/profile_tp_decode.py --shape llama3-70b \
    --layers 8 --modes $m --prompt 512 --steps 32 --work /tmp/kp --out $OUT/$k-$m > $OUT/$k-$m.txt 2>&1
  echo "$k $m rc=$? t=$((SECONDS-S))" >> $L
  grep -h "tok/s" $OUT/$k-$m.txt >> $L
  for t in $OUT/$k-$m/*.trace.json; do
    python tools/critical_path.py $t --top 12 >> $L 2>&1; gzip -9 $t
  done
}
run push single; run push tp4; run flags tp4; run push tp; run flags tp
cat $L
