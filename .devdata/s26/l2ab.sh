#!/usr/bin/env bash
# Next GPU session (issues 28 and 33): the decode GEMV's L2 prefetch (KESTREL_GEMV_L2_PREFETCH=1,
# off by default) against main, Kestrel only, each pair in one call on one machine.
#   bash .devdata/s26/l2ab.sh one  : kind nvidia-h200, carry .devdata/s11/w, timeout 590.
#       The GPU test, then tools/bench.py 8B GPTQ and EXL2 (P512), then the 70B GPTQ P512, each
#       without and with the prefetch (bench builds each model once under /tmp/kestrel-bench).
#   bash .devdata/s26/l2ab.sh tp   : kind nvidia-h200-x2: 70B TP=2 and 8B TP=2 without and with
#       (tools/multigpu_check.py; greedy compared with one GPU's run of the same call).
# If the prefetch pays: make it the default (GemvConfig), rerun the GPU tests, README numbers.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/l2ab-${1:-one}.log; S=$SECONDS
nvidia-smi --query-gpu=index,name --format=csv,noheader > $L
tok() { python - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps(d)[:700])
PY
}
case "${1:-}" in
one)
    # Session 26 changed these after its last GPU run (CPU-checked only): run them first.
    timeout 240 python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider \
        tests/kernels/test_gemv_l2_prefetch.py tests/kernels/test_qkv_rope.py \
        tests/kernels/test_slot_sum_rope.py tests/engine/test_norm_fold_engine.py > $OUT/pytest.txt 2>&1
    echo "gpu tests rc=$? $(tail -1 $OUT/pytest.txt) t=$((SECONDS-S))" >> $L
    for job in "llama3-8b gptq" "llama3-8b exl2" "llama3-70b gptq"; do
        set -- $job
        for v in 0 1; do
            [ $((SECONDS-S)) -gt 500 ] && break 2
            KESTREL_GEMV_L2_PREFETCH=$v timeout $((580-(SECONDS-S))) python tools/bench.py --shape $1 \
                --format $2 --prompts 512 --engines kestrel --json $OUT/$1-$2-l2$v.json > /tmp/b.txt 2>&1
            echo "$1 $2 l2=$v rc=$? t=$((SECONDS-S))" >> $L; tail -3 /tmp/b.txt >> $L
        done
    done
    ;;
tp)
    timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_multigpu.py \
        > $OUT/pytest_multigpu.txt 2>&1
    echo "test_multigpu rc=$? $(tail -1 $OUT/pytest_multigpu.txt) t=$((SECONDS-S))" >> $L
    for shape in llama3-70b llama3-8b; do
        timeout 200 python tools/multigpu_check.py --shape $shape --format gptq --modes single \
            --work /tmp/k --out $OUT/mg > /tmp/mg.txt 2>&1
        echo "$shape single rc=$? t=$((SECONDS-S))" >> $L
        for v in 0 1; do
            [ $((SECONDS-S)) -gt 520 ] && break 2
            mkdir -p /tmp/mg$v && cp $OUT/mg/$shape-gptq-single.json /tmp/mg$v/
            KESTREL_GEMV_L2_PREFETCH=$v timeout 120 python tools/multigpu_check.py --shape $shape \
                --format gptq --modes tp --work /tmp/k --out /tmp/mg$v > /tmp/mg.txt 2>&1
            echo "$shape tp l2=$v rc=$? t=$((SECONDS-S))" >> $L
            tok /tmp/mg$v/$shape-gptq-tp.json >> $L
            cp /tmp/mg$v/$shape-gptq-summary.json $OUT/$shape-summary-l2$v.json
        done
    done
    ;;
*) echo "usage: l2ab.sh one|tp"; exit 2 ;;
esac
cat $L
