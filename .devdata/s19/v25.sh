#!/usr/bin/env bash
# Session 19, issue 29 on a GPU: Kestrel's converter with the sensitivity probe (default kl)
# on Gemma-3-270M, default calibration, 4.0 and 3.0 bpw, 20 windows a domain; then the same
# measurement allocated without the probe (--sensitivity off) at 4.0, evaluated the same way.
# No exllamav2 this time (its build and measurement do not fit the session's device time).
# After the five carry calls of .devdata/s16/q29.sh (gemma c0..c4), on the same warm machine:
#   call A: bash .devdata/s19/v25.sh stage  (carry .devdata/s11/w .devdata/s14/d/small)
#   call B: bash .devdata/s19/v25.sh run    (no carry)
set -u
W=/tmp/q29; SITE=$W/site
export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1
case "${1:-}" in
stage)
    mkdir -p "$SITE" "$W/wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
        .devdata/s11/w/gguf-0.19.0-py3-none-any.whl \
        .devdata/s11/w/llguidance-1.6.1-cp39-abi3-manylinux_2_28_x86_64.whl
    xz -dc .devdata/s14/d/small/wiki.utf8.xz > "$W/wiki.utf8"
    cat "$W"/in/piece0* | tar -x -C "$W/wheels"
    PIP_NO_INDEX=1 PIP_FIND_LINKS="$W/wheels" python3 -m loader.default_model gemma-3-270m \
        --models-dir "$W/models" --quiet > "$OUT/import-gemma.txt" 2>&1
    echo "Gemma import rc=$? -> $(tail -1 "$OUT/import-gemma.txt")"
    ;;
run)
    M=$(ls -d $W/models/gemma-3-270m* | head -1)
    t0=$SECONDS
    timeout 420 python3 tools/compare_converters.py --model $M --kestrel-bits 4 3 \
        --calibrations default --windows 20 --device cuda:0 --work $W/work-kl \
        --json $OUT/q29-gemma-kl.json > $OUT/q29-gemma-kl.txt 2>&1
    echo "compare rc=$? t=$((SECONDS - t0))"; grep -v "^\s" $OUT/q29-gemma-kl.txt | tail -6
    cp $W/work-kl/*measurement*.json $OUT/ 2>/dev/null
    MEAS=$(ls $W/work-kl/*measurement*.json | head -1)
    timeout $((560 - (SECONDS - t0))) python3 convert.py -i $M -o $W/off-4 -m $MEAS -b 4 \
        --sensitivity off --device cuda:0 -q > $OUT/off-4.txt 2>&1 && \
    timeout $((580 - (SECONDS - t0))) python3 tools/perplexity.py -m $W/off-4 --domains \
        --windows 20 --device cuda > $OUT/off-4-ppl.txt 2>&1
    echo "off rc=$? t=$((SECONDS - t0))"; tail -4 $OUT/off-4-ppl.txt
    ;;
*) echo "usage: v25.sh stage | run"; exit 2 ;;
esac
