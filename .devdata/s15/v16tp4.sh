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
run() {  # kernel, modes...
  local k=$1; shift
  KESTREL_TP_SITE_KERNEL=$k timeout 200 python tools/profile_tp_decode.py --shape llama3-70b \
    --layers 8 --modes "$@" --prompt 512 --steps 32 --work /tmp/kp --out $OUT/$k > $OUT/$k.txt 2>&1
  echo "$k $* rc=$? t=$((SECONDS-S))" >> $L
  grep -h "tok/s" $OUT/$k.txt >> $L
  for t in $OUT/$k/*.trace.json; do
    python tools/critical_path.py $t --top 12 >> $L 2>&1; gzip -9 $t
  done
}
run push single tp tp4
run flags tp tp4
cat $L
