#!/usr/bin/env bash
# Session 16, issue 33: is the push all-reduce (KESTREL_TP_SITE_KERNEL=push) ready to be the
# default? Two GPUs (kind nvidia-h100-x2), run in the repository root (main), timeout 540:
#   1. tests/engine/test_multigpu.py whole with push (TP matches one GPU; ~105 s with flags),
#   2. tools/check_tp_all_reduce.py --kernel push (bits, graph replays, speed),
#   3. tools/multigpu_check.py on the 8B GPTQ: single, tp (push), greedy tokens compared,
#      then tp with flags (--out tp-flags) for the same-run ratio.
# carry [".devdata/s11/w"] (llguidance etc.). Results under $OUT; summary $OUT/v16tp.log.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:/tmp/site
L=$OUT/v16tp.log; S=$SECONDS
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > $L
KESTREL_TP_SITE_KERNEL=push timeout 240 python -m pytest -q -m gpu -p no:cacheprovider \
  tests/engine/test_multigpu.py > $OUT/pytest_multigpu_push.txt 2>&1
echo "test_multigpu push rc=$? $(tail -1 $OUT/pytest_multigpu_push.txt) t=$((SECONDS-S))" >> $L
# A process sets up symmetric memory once: in the run above only its first TP test had the
# site kernel. Each TP test again in a process of its own, so every one runs the push kernel.
for id in $(python -m pytest -q --collect-only -m gpu -p no:cacheprovider tests/engine/test_multigpu.py 2>/dev/null | grep -E '::test_tensor_parallel'); do
  KESTREL_TP_SITE_KERNEL=push timeout 120 python -m pytest -q -m gpu -p no:cacheprovider "$id" > $OUT/one.txt 2>&1
  echo "  $id rc=$? $(tail -1 $OUT/one.txt) t=$((SECONDS-S))" >> $L
done
timeout 60 python tools/check_tp_all_reduce.py --kernel push --out $OUT > $OUT/check.txt 2>&1
echo "check push rc=$? $(grep -h '"ok"\|site_sum' $OUT/check_tp_all_reduce-push.json | tr -d '\n ') t=$((SECONDS-S))" >> $L
KESTREL_TP_SITE_KERNEL=push timeout 150 python tools/multigpu_check.py --shape llama3-8b --format gptq \
  --modes single tp --work /tmp/kmg --out $OUT/mg > $OUT/mg.txt 2>&1
echo "multigpu_check push rc=$? t=$((SECONDS-S))" >> $L
KESTREL_TP_SITE_KERNEL=flags timeout 90 python tools/multigpu_check.py --shape llama3-8b --format gptq \
  --modes tp --work /tmp/kmg --out $OUT/mg-flags > $OUT/mg-flags.txt 2>&1
echo "multigpu_check flags rc=$? t=$((SECONDS-S))" >> $L
python - "$OUT" >> $L 2>&1 <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
for f in sorted(o.glob("mg*/*.json")):
    d = json.loads(f.read_text())
    keys = ("decode_tok_s", "decode_sync_tok_s", "prefill_tok_s", "greedy_matches", "tokens_match")
    print(f.relative_to(o), {k: d[k] for k in keys if k in d})
PY
cat $L
