#!/usr/bin/env bash
# Session 23, issue 28: the leaner decode GEMV loop.
#   bash .devdata/s23/v28.sh lean   : GPU tests of the GEMV paths, then lean_ab.py (main vs lean,
#                                     8B GPTQ and EXL2, alternating, each in its own process).
# main's GEMV for the A/Bs is not kept here: first
#   git show f5f8c6c:kernels/quant_matmul/gemv.py > .devdata/s23/gemv_main.py
#   bash .devdata/s23/v28.sh tune   : tools/tune_gemv.py per shape, main's GEMV then the lean one.
set -u
[ -d /tmp/site/llguidance ] || pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
S=$SECONDS
case "${1:-}" in
lean)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $OUT/smi.txt
    timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_quant_matmul_kernels.py \
        tests/kernels/test_row_order.py tests/kernels/test_split_k_sums.py tests/kernels/test_gate_up_silu.py \
        tests/kernels/test_norm_fold.py tests/engine/test_norm_fold_engine.py \
        tests/kernels/test_programmatic_launch.py 2>&1 | tail -15 | tee $OUT/pytest_lean.txt
    echo "tests t=$((SECONDS - S))"
    timeout $((585 - (SECONDS - S))) python3 .devdata/s23/lean_ab.py $OUT/lean_ab.json ${FORMATS:-gptq exl2} 2>&1 | tail -12
    echo "ab t=$((SECONDS - S))"
    ;;
tune)
    cp kernels/quant_matmul/gemv.py /tmp/gemv_lean.py
    for v in main lean; do
        if [ $v = main ]; then cp .devdata/s23/gemv_main.py kernels/quant_matmul/gemv.py; else cp /tmp/gemv_lean.py kernels/quant_matmul/gemv.py; fi
        for f in ${FORMATS:-gptq exl2}; do
            [ $((SECONDS - S)) -gt 500 ] && break
            if [ $v = lean ] && [ $f = gptq ]; then SWEEP=${LEAN_SWEEP:---warps 4 --cols 8 --programs-per-sm 2 --max-iters 4}; else SWEEP="--warps 4 --cols 8 --programs-per-sm 2 --max-iters 4"; fi
            timeout $((580 - (SECONDS - S))) python3 tools/tune_gemv.py --format $f --out /tmp/tune-$v-$f \
                $SWEEP --prefetch on > /tmp/tune-$v-$f.txt 2>&1
            cp /tmp/tune-$v-$f/tune.json $OUT/tune-$v-$f.json 2>/dev/null
            echo "== $v $f t=$((SECONDS - S))"; grep -v "^ " /tmp/tune-$v-$f.txt | tail -12
        done
    done
    cp /tmp/gemv_lean.py kernels/quant_matmul/gemv.py
    ;;
variants)
    # The lean GEMV's prefetch depth and unroll (KESTREL_GEMV_DEPTH / _UNROLL, experiment
    # knobs) per shape, main's GEMV as the control; then lean_ab.py with the best pair.
    cp kernels/quant_matmul/gemv.py /tmp/gemv_lean.py
    cp .devdata/s23/gemv_main.py kernels/quant_matmul/gemv.py
    for f in gptq exl2; do
        python3 tools/tune_gemv.py --format $f --out /tmp/tune-main-$f --warps 4 --cols 8 \
            --programs-per-sm 2 --max-iters 4 --prefetch on > /tmp/tune-main-$f.txt 2>&1
        echo "== main $f t=$((SECONDS - S))"; grep -v "^ " /tmp/tune-main-$f.txt | tail -7
    done
    cp /tmp/gemv_lean.py kernels/quant_matmul/gemv.py
    for du in ${VARIANTS:-1,1 2,1 1,2 1,4}; do
        for f in gptq exl2; do
            KESTREL_GEMV_DEPTH=${du%,*} KESTREL_GEMV_UNROLL=${du#*,} python3 tools/tune_gemv.py --format $f \
                --out /tmp/tune-$du-$f --warps 4 --cols 8 --programs-per-sm 2 --max-iters 4 \
                --prefetch on > /tmp/tune-$du-$f.txt 2>&1
            echo "== d,u=$du $f t=$((SECONDS - S))"; grep -v "^ " /tmp/tune-$du-$f.txt | tail -7
        done
    done
    python3 - <<'PY' > $OUT/variants.json
import json, glob
out = {}
for f in glob.glob("/tmp/tune-*/tune.json"):
    d = json.load(open(f))
    out[f.split("/")[2]] = {"default_total_us": d["default_total_us"],
        "shapes": {f"{s['k']}x{s['n']}": s["default"]["us"] for s in d["shapes"]}}
print(json.dumps(out, indent=1))
PY
    BEST=$(python3 -c "
import json; d = json.load(open('$OUT/variants.json'))
tot = {}
for k, v in d.items():
    du = k[len('tune-'):].rsplit('-', 1)[0]
    if du != 'main': tot[du] = tot.get(du, 0) + v['default_total_us']
print(min(tot, key=tot.get))")
    echo "best d,u=$BEST t=$((SECONDS - S))"
    KESTREL_GEMV_DEPTH=${BEST%,*} KESTREL_GEMV_UNROLL=${BEST#*,} timeout $((585 - (SECONDS - S))) \
        python3 .devdata/s23/lean_ab.py $OUT/lean_ab.json gptq exl2 2>&1 | tail -10
    ;;
bench)
    # tools/bench.py for GPTQ and EXL2 with exllamav2 0.3.2 (built on the CPU meanwhile).
    W=/tmp/exl; mkdir -p $W/site
    python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site \
        .devdata/s11/w/exllamav2-0.3.2-py3-none-any.whl > $W/pip.txt 2>&1
    sed -i 's/block_diag_layers or causal:/block_diag_layers:/' $W/site/exllamav2/attn.py
    PYTHONPATH=$W/site:$PYTHONPATH TORCH_EXTENSIONS_DIR=$W/ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 \
        timeout 300 python3 -c "import exllamav2, exllamav2.ext" > $W/build.txt 2>&1
    echo "build rc=$? t=$((SECONDS - S))"
    for f in gptq exl2; do
        left=$((470 - (SECONDS - S))); [ $left -lt 60 ] && break
        PYTHONPATH=$W/site:$PYTHONPATH TORCH_EXTENSIONS_DIR=$W/ext timeout $left \
            python3 tools/bench.py --format $f --prompts 512 8192 --json $OUT/bench-$f.json \
            > $OUT/bench-$f.txt 2>&1
        echo "bench $f rc=$? t=$((SECONDS - S))"; tail -12 $OUT/bench-$f.txt
    done
    ;;
*) echo "usage: v28.sh lean|tune|variants|bench"; exit 2 ;;
esac
