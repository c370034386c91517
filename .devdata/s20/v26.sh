#!/usr/bin/env bash
# Session 20: issue 29 on one warm nvidia-h200 (exllamav2 on Gemma-3-270M for the first time,
# and SmolLM2 again with the sensitivity probe), plus main's single-GPU test suite.
# After the seven carry calls of .devdata/s16/q29.sh (gemma c0..c4, gguf.part0, gguf.part1):
#   call A: bash .devdata/s20/v26.sh stage (carry .devdata/s11/w .devdata/s14/d/small):
#           `pytest -m gpu` runs on the idle GPU while exllamav2's extension builds on the CPU.
#   call B+: bash .devdata/s20/v26.sh run gemma|smol (no carry), repeated until it says
#           "V26 <model> DONE": every converter x calibration runs as its own tools/compare_converters.py
#           process at once (the small models leave the GPU mostly idle in one process), and
#           exllamav2's second width starts as soon as its measurement is written. Finished
#           outputs are skipped on a rerun. Conversion seconds here are NOT comparable (shared
#           GPU); the perplexities are.
set -u
W=/tmp/q29
case "${1:-}" in
stage)
    pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
    # The image lacks openai, jsonschema and fastapi: the API and constraint tests stay home.
    GPU_TESTS=$(grep -rl "mark.gpu" tests | grep -v -e test_openai_ -e test_constraints \
        -e test_hostile_files | sort | tr '\n' ' ')
    ( PYTHONPATH=$PWD:/tmp/site timeout 480 python -m pytest -q -m gpu -p no:cacheprovider \
        --durations=10 $GPU_TESTS > $OUT/pytest_gpu.txt 2>&1; echo "rc=$?" >> $OUT/pytest_gpu.txt ) &
    TP=$!
    bash .devdata/s16/q29.sh stage
    wait $TP
    echo "pytest gpu: $(grep -E 'passed|failed|rc=' $OUT/pytest_gpu.txt | tail -2 | tr '\n' ' ')"
    grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | head -20
    ;;
run)
    [ -f $W/site/exllamav2/attn.py ] && [ -d $W/models ] || { echo "STAGING LOST"; exit 3; }
    export PYTHONPATH=$W/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
    export TORCH_EXTENSIONS_DIR=$W/ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
    case "${2:-}" in
        gemma) MODEL=$(ls -d $W/models/gemma-3-270m* | head -1) ;;
        smol) MODEL=$W/models/smol-fp16 ;;
        *) echo "run gemma|smol"; exit 2 ;;
    esac
    TAG=$2; S=$SECONDS; mkdir -p $W/v26 $OUT/v26
    cmp() {  # name calibration extra args...
        local name=$1 cal=$2; shift 2
        timeout $((555 - (SECONDS - S))) python3 tools/compare_converters.py --model $MODEL \
            --calibrations $cal --shared-text $W/wiki.utf8 --device cuda:0 --windows 20 \
            --work $W/v26/${name%-[34]} --json $W/v26/$name.json "$@" > $W/v26/$name.log 2>&1
        echo "$name rc=$? t=$((SECONDS - S))" >> $W/v26/status-$TAG.txt
    }
    exl_pair() {  # calibration: width 4 measures, width 3 starts once the measurement is written
        local cal=$1
        cmp $TAG-exl-$cal-4 $cal --exllamav2-bits 4 --kestrel-bits &
        local p=$! m=$W/v26/$TAG-exl-$cal/exllamav2-$cal-measurement.json
        while [ ! -f $m ] && kill -0 $p 2> /dev/null; do sleep 3; done
        sleep 5
        cmp $TAG-exl-$cal-3 $cal --exllamav2-bits 3 --kestrel-bits
        wait
    }
    exl_pair default & exl_pair shared &
    cmp $TAG-k-default default --kestrel-bits 4 3 &
    cmp $TAG-k-shared shared --kestrel-bits 4 3 &
    wait
    # Few files come back from a call: the JSONs, and one tar of every log.
    cp $W/v26/*.json $OUT/v26/ 2>/dev/null
    tar -czf $OUT/v26/logs.tgz -C $W/v26 $(cd $W/v26 && ls -d *.log status-*.txt */*.log 2>/dev/null)
    cat $W/v26/status-$TAG.txt
    [ "$(tail -6 $W/v26/status-$TAG.txt | grep -c 'rc=0')" -eq 6 ] && echo "V26 $TAG DONE"
    ;;
*) echo "usage: v26.sh stage | run"; exit 2 ;;
esac
