#!/usr/bin/env bash
# Issue 29, next GPU session: the README's converter comparison with the Hessian shrinkage
# (--shrink 0.3; off by default since it cost Gemma-3-270M on the CPU) on the shared text.
# Staging as .devdata/s16/q29.sh says (one warm machine, timeout_s 600 each):
#   calls 1-7: "bash .devdata/s16/q29.sh carry DIR" with carry [DIR], for DIR in
#     .devdata/s16/gemma/c0 ... c4, .devdata/s14/d/gguf.part0, .devdata/s14/d/gguf.part1;
#   call 8: "bash .devdata/s16/q29.sh stage", carry [".devdata/s11/w", ".devdata/s14/d/small"]
#     (exllamav2 built, both models imported, wiki.utf8 unpacked);
#   calls 9+: "bash .devdata/s24/q29.sh run smol" then "... run gemma" (no carry): Kestrel and
#     exllamav2 on the shared text at 4.0 and 3.0 bpw, 20 windows a domain; a rerun skips
#     what --work holds already, so repeat a call until it prints "Q29S <model> DONE".
# Results: $OUT/q29s-<model>.json (compare_converters' JSON) and its log.
set -uo pipefail
W=/tmp/q29
export PYTHONPATH=$W/site:$PWD PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=$W/ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
case "${1:-}" in
run)
    [ -f "$W/site/exllamav2/attn.py" ] && [ -d "$W/models" ] \
        || { echo "STAGING LOST: redo the carry calls and the stage call"; exit 3; }
    case "${2:-}" in
        smol) MODEL=$W/models/smol-fp16 ;;
        gemma) MODEL=$(ls -d "$W"/models/gemma-3-270m* | head -1) ;;
        *) echo "run smol|gemma"; exit 2 ;;
    esac
    timeout 570 python3 tools/compare_converters.py --model "$MODEL" --calibrations shared \
        --shared-text "$W/wiki.utf8" --kestrel-bits 4 3 --exllamav2-bits 4 3 --windows 20 \
        --kestrel-args=--shrink=0.3 \
        --device cuda:0 --work "$W/s24-$2" --json "$OUT/q29s-$2.json" > "$OUT/q29s-$2.txt" 2>&1
    rc=$?
    tail -20 "$OUT/q29s-$2.txt"
    [ $rc -eq 0 ] && echo "Q29S $2 DONE"
    ;;
*) echo "usage: q29.sh run smol|gemma"; exit 2 ;;
esac
