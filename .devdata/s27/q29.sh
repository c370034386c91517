#!/usr/bin/env bash
# Session 27, issue 29: is exllamav2's SmolLM2 4.0-bpw shared-text multilingual figure (43.97 in
# session 20; 43.87-45.16 in earlier runs) the same from run to run, and where does Kestrel's
# shrinkage 0.5 put that cell (0.3, the auto choice: 43.99)? One warm nvidia-h200, back to back:
#   1. "bash .devdata/s16/q29.sh carry .devdata/s14/d/gguf.part1", carry [.devdata/s14/d/gguf.part1]
#   2. "bash .devdata/s27/q29.sh stage", carry [.devdata/s14/d/gguf.part0, .devdata/s11/w,
#      .devdata/s14/d/small]  (SmolLM2 only: the Gemma import in s16's stage fails quickly)
#   3. "bash .devdata/s27/q29.sh run" (no carry), timeout 595.
set -uo pipefail
W=/tmp/q29
case "${1:-}" in
stage)
    bash .devdata/s16/q29.sh carry .devdata/s14/d/gguf.part0
    bash .devdata/s16/q29.sh stage
    ;;
run)
    [ -d "$W/models/smol-fp16" ] || { echo "STAGING LOST"; exit 3; }
    export PYTHONPATH=$W/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=$W/ext
    M=$W/models/smol-fp16
    common=(--model "$M" --calibrations shared --shared-text "$W/wiki.utf8" --windows 20 --device cuda:0)
    for i in 1 2 3; do
        timeout 560 python3 tools/compare_converters.py "${common[@]}" --kestrel-bits \
            --exllamav2-bits 4 --work "$W/x$i" --json "$OUT/exl-rep$i.json" > "$OUT/exl-rep$i.txt" 2>&1 &
    done
    timeout 560 python3 tools/compare_converters.py "${common[@]}" --kestrel-bits 4 \
        --kestrel-quantize-args=--shrink=0.5 --work "$W/k05" --json "$OUT/kes-s05.json" > "$OUT/kes-s05.txt" 2>&1 &
    wait
    for f in "$OUT"/*.txt; do echo "== $f"; tail -6 "$f"; done
    ;;
*) echo "usage: q29.sh stage|run"; exit 2 ;;
esac
