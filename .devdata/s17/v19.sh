#!/usr/bin/env bash
# Session 17, issue 33 (kind nvidia-h200-x2, carry .devdata/s16/b .devdata/s11/w, timeout 590).
# v18b: wip/s16-33f's 8B TP=2 greedy diverged from one GPU's at token 25 (push and slots),
# where s16's main (before the decode-attention early reads, 28d) was identical. Which is it:
# main now (push twice: run-to-run?), main with flags, branch push; plus the fixed timeout test.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/v19.log; S=$SECONDS; ROOT=$PWD
tok() { python - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); print(r["greedy_tokens"][:40], round(r["decode_tok_s"], 1))
PY
}
run() {  # tree mode kernel tag
  cd $1; PYTHONPATH=$PWD:/tmp/site KESTREL_TP_SITE_KERNEL=$3 timeout 80 python tools/multigpu_check.py \
    --shape llama3-8b --format gptq --modes $2 --work /tmp/kmg --out $OUT/mg > $OUT/mg-$4.txt 2>&1
  echo "$4 rc=$? t=$((SECONDS-S))" >> $L
  cp $OUT/mg/llama3-8b-gptq-$2.json $OUT/mg/$4.json; echo "  $(tok $OUT/mg/$4.json)" >> $L; cd $ROOT
}
cd .devdata/s16/b && PYTHONPATH=$PWD:/tmp/site timeout 100 python -m pytest -q -m "gpu or not gpu" \
  -p no:cacheprovider tests/kernels/test_tp_peer_timeout.py > $OUT/pytest_timeout.txt 2>&1
echo "timeout tests rc=$? $(tail -1 $OUT/pytest_timeout.txt) t=$((SECONDS-S))" >> $L; cd $ROOT
run $ROOT single push main-single
run $ROOT tp push main-push-1
run $ROOT tp push main-push-2
run $ROOT tp flags main-flags
run $ROOT/.devdata/s16/b tp push branch-push
run $ROOT single push main-single-2
cat $L
