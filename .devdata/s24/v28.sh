#!/usr/bin/env bash
# Session 24, issue 28: the GEMV's chunk loop software-pipelined by Triton (GemvConfig.stages:
# cp.async into shared memory, stages - 1 chunks ahead) against the register prefetch.
#   bash .devdata/s24/v28.sh stages : GPU tests, then tools/tune_gemv.py over stages x prefetch
#                                     x iters x warps for GPTQ and EXL2.
#   A='{}' B='{"stages": 3}' bash .devdata/s24/v28.sh ab : decode-graph A/B (config_ab.py).
#   bash .devdata/s24/v28.sh bench  : as .devdata/s23/v28.sh bench.
set -u
[ -d /tmp/site/llguidance ] || pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
S=$SECONDS
case "${1:-}" in
stages)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $OUT/smi.txt
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_quant_matmul_kernels.py \
        tests/kernels/test_row_order.py tests/kernels/test_split_k_sums.py 2>&1 | tail -6 | tee $OUT/pytest.txt
    echo "tests t=$((SECONDS - S))"
    for f in ${FORMATS:-gptq exl2}; do
        timeout $((585 - (SECONDS - S))) python3 tools/tune_gemv.py --format $f --out /tmp/tune-$f \
            --warps ${WARPS:-4} --cols 8 --programs-per-sm ${PPS:-2} --max-iters ${ITERS:-4 8} \
            --prefetch both --stages ${STAGES:-1 2 3 4} > /tmp/tune-$f.txt 2>&1
        cp /tmp/tune-$f/tune.json $OUT/tune-$f.json 2>/dev/null; cp /tmp/tune-$f.txt $OUT/
        echo "== $f t=$((SECONDS - S))"; grep -v "Error\|^  [0-9]*x[0-9]* w" /tmp/tune-$f.txt | tail -50
    done
    ;;
ab)
    timeout 585 python3 .devdata/s24/config_ab.py $OUT/config_ab.json "${A:-{\}}" "${B}" ${FORMATS:-gptq exl2} 2>&1 | tail -12
    ;;
bench)
    bash .devdata/s23/v28.sh bench
    ;;
*) echo "usage: v28.sh stages|ab|bench"; exit 2 ;;
esac
