#!/usr/bin/env bash
# Session 22, issue 28: cache warming before the PDL wait in the decode GEMV.
#   bash .devdata/s22/v28.sh ab     : GPU tests of the warming, the decode A/B (warm_ab.py),
#                                     then tools/tune_gemv.py per shape (cold weights) per format.
set -u
[ -d /tmp/site/llguidance ] || pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
S=$SECONDS
case "${1:-}" in
ab)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $OUT/smi.txt
    [ -n "${SKIP_TESTS:-}" ] || timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels/test_quant_matmul_kernels.py -k "warm" 2>&1 | tail -4 | tee $OUT/pytest_warm.txt
    timeout 400 python3 .devdata/s22/warm_ab.py $OUT/warm_ab.json gptq exl2 2>&1 | tail -14 | tee $OUT/warm_ab.txt
    echo "ab t=$((SECONDS - S))"
    for f in gptq exl2; do
        [ $((SECONDS - S)) -gt 480 ] && break
        timeout $((560 - (SECONDS - S))) python3 tools/tune_gemv.py --format $f --out /tmp/tune-$f \
            --warps 4 --cols 8 --programs-per-sm 2 --max-iters 4 --prefetch on \
            --warm none meta words both > /tmp/tune-$f.txt 2>&1
        cp /tmp/tune-$f/tune.json $OUT/tune-$f.json 2>/dev/null
        grep -v "^ " /tmp/tune-$f.txt | tail -12 > $OUT/tune-$f.txt; cat /tmp/tune-$f.txt | tail -40
    done
    echo "tune t=$((SECONDS - S))"
    ;;
gap)
    timeout 300 python3 .devdata/s22/exl2_gap.py $OUT/exl2_gap.json 2>&1 | tail -8
    ;;
order)
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_row_order.py \
        tests/engine/test_norm_fold_engine.py tests/kernels/test_norm_fold.py \
        tests/kernels/test_programmatic_launch.py 2>&1 | tail -5 | tee $OUT/pytest_order.txt
    echo "tests t=$((SECONDS - S))"
    timeout $((580 - (SECONDS - S))) python3 .devdata/s22/order_ab.py $OUT/order_ab.json 2>&1 | tail -8
    ;;
probe)
    timeout 300 python3 .devdata/s22/order_probe.py $OUT/order_probe.json 2>&1 | tail -12
    ;;
scatter)
    timeout 300 python3 .devdata/s22/scatter_probe.py $OUT/scatter_probe.json 2>&1 | tail -12
    ;;
scatter_ab)
    timeout 120 python3 .devdata/s22/scatter_probe.py $OUT/scatter_probe.json 2>&1 | tail -6
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_row_order.py \
        tests/engine/test_norm_fold_engine.py -k "row_order" 2>&1 | tail -2 | tee $OUT/pytest_order.txt
    timeout $((580 - (SECONDS - S))) python3 .devdata/s22/order_ab.py $OUT/order_ab.json 2>&1 | tail -8
    ;;
final)
    # exllamav2 0.3.2 for bench.py, built on the CPU while the GPU runs tests and the A/B.
    W=/tmp/exl; mkdir -p $W/site
    ( python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site \
        .devdata/s11/w/exllamav2-0.3.2-py3-none-any.whl > $W/pip.txt 2>&1
      sed -i 's/block_diag_layers or causal:/block_diag_layers:/' $W/site/exllamav2/attn.py
      PYTHONPATH=$W/site:$PYTHONPATH TORCH_EXTENSIONS_DIR=$W/ext MAX_JOBS=14 TORCH_CUDA_ARCH_LIST=9.0 \
        timeout 400 python3 -c "import exllamav2, exllamav2.ext" > $W/build.txt 2>&1
      echo "build rc=$?" >> $W/build.txt ) &
    BUILD=$!
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_norm_fold_engine.py \
        tests/kernels/test_norm_fold.py tests/kernels/test_slot_sum_rope.py \
        tests/kernels/test_programmatic_launch.py tests/kernels/test_split_k_sums.py 2>&1 \
        | tail -3 | tee $OUT/pytest_final.txt
    echo "tests t=$((SECONDS - S))"
    timeout 200 python3 .devdata/s22/order_ab.py $OUT/order_ab.json 2>&1 | tail -6
    echo "ab t=$((SECONDS - S))"
    wait $BUILD; tail -2 $W/build.txt
    grep -q "block_diag_layers or causal:" $W/site/exllamav2/attn.py && echo "causal fix NOT applied"
    for f in exl2 gptq; do
        left=$((585 - (SECONDS - S))); [ $left -lt 60 ] && break
        PYTHONPATH=$W/site:$PYTHONPATH TORCH_EXTENSIONS_DIR=$W/ext timeout $left \
            python3 tools/bench.py --format $f --prompts 512 8192 --json $OUT/bench-$f.json \
            > $OUT/bench-$f.txt 2>&1
        echo "bench $f rc=$? t=$((SECONDS - S))"; tail -12 $OUT/bench-$f.txt
    done
    ;;
tests)
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
        tests/kernels/test_quant_matmul_kernels.py tests/kernels/test_programmatic_launch.py 2>&1 | tail -15
    ;;
*) echo "usage: v28.sh ab|tests"; exit 2 ;;
esac
