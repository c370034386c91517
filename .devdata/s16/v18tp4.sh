#!/usr/bin/env bash
# Session 17, issue 33's table on 4 GPUs (kind nvidia-h100-x4; timeout 590; carry .devdata/s11/w):
# the 70B GPTQ shape whole, P512, one GPU, TP=2 and TP=4 with the push all-reduce (main's
# default since session 16), greedy tokens against one GPU. One process per TP mode (a
# process sets up symmetric memory once), all writing to $OUT/mg so that each TP run compares
# its greedy tokens with the single run's there. The random 70B is built once under /tmp/k70.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:/tmp/site
L=$OUT/v18tp4.log; S=$SECONDS
nvidia-smi --query-gpu=index,name --format=csv,noheader > $L
for m in single tp tp4; do
  timeout 240 python tools/multigpu_check.py --shape llama3-70b --format gptq --modes $m \
    --work /tmp/k70 --out $OUT/mg > $OUT/mg-$m.txt 2>&1
  echo "70b $m rc=$? t=$((SECONDS-S))" >> $L
done
python - "$OUT" >> $L 2>&1 <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
for f in sorted(o.glob("mg/*.json")):
    d = json.loads(f.read_text())
    keys = ("mode", "load_s", "gpu_mem_used_gib", "decode_tok_s", "decode_sync_tok_s", "prefill_tok_s")
    print(f.relative_to(o), {k: d[k] for k in keys if k in d})
PY
cat $L
