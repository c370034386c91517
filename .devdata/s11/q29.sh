#!/usr/bin/env bash
# Issue 29 device plan (one H100). Run from the repo root, calls back to back (the machine
# must stay warm: /tmp/q29 is lost when it is given back).
#   call 1: bash .devdata/s11/q29.sh stage   carry: .devdata/s11/q29.sh .devdata/s11/q29_run.py .devdata/s11/q29/gguf.part0
#   call 2: bash .devdata/s11/q29.sh         carry: .devdata/s11/q29.sh .devdata/s11/q29_run.py .devdata/s11/q29/gguf.part1 .devdata/s11/q29/small
#   call 3+: bash .devdata/s11/q29.sh        carry: .devdata/s11/q29.sh .devdata/s11/q29_run.py
# Repeat the last until the log ends with "Q29 ALL DONE". Results: $OUT/q29-results.json,
# $OUT/q29-log.txt (the runner resumes: finished steps are skipped).
set -euo pipefail
W=/tmp/q29
D=.devdata/s11/q29
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
FP16_SHA=d8d8571b3af99053c8ad455ce009d8479eec5da515f80a417c075d0a7f317904  # earlier imports
OUT=${OUT:-/tmp/q29-out}
mkdir -p "$W" "$OUT"
exec > >(tee -a "$OUT/q29-log.txt") 2>&1
echo "== q29 ${1:-run} on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%FT%TZ)"

if [ "${1:-run}" = stage ]; then
    cp "$D/gguf.part0" "$W/gguf.part0"
    echo "staged part 0 ($(stat -c %s "$W/gguf.part0") bytes); make call 2 now"
    exit 0
fi

export PYTHONPATH=/tmp/site:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -f "$W/smol-fp16/model.safetensors" ]; then
    if [ ! -f "$W/gguf.part0" ] || [ ! -f "$D/gguf.part1" ]; then
        echo "Q29 STAGING LOST: /tmp/q29/gguf.part0 or the carried part 1 is missing;"
        echo "the machine went cold. Redo call 1 (stage) and call 2."
        exit 3
    fi
    cat "$W/gguf.part0" "$D/gguf.part1" > "$W/smol.gguf"
    echo "$GGUF_SHA  $W/smol.gguf" | sha256sum -c -
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        "$D/small/gguf-0.19.0-py3-none-any.whl"
    xz -dc "$D/small/wiki.utf8.xz" > "$W/wiki.utf8"
    python3 -m engine.gguf_import "$W/smol.gguf" "$W/smol-fp16.tmp" --overwrite
    mv "$W/smol-fp16.tmp" "$W/smol-fp16"
    got=$(sha256sum "$W/smol-fp16/model.safetensors" | cut -d' ' -f1)
    if [ "$got" = "$FP16_SHA" ]; then echo "FP16 import: SHA-256 as before";
    else echo "NOTE: FP16 import SHA-256 $got differs from the earlier $FP16_SHA"; fi
    echo "staging done after ${SECONDS} s"
fi
# Leave ~40 s of the 600 s call for the transfer back and the last save.
python3 .devdata/s11/q29_run.py --model "$W/smol-fp16" --work "$W" --out "$OUT" \
    --wiki "$W/wiki.utf8" --deadline-s $((555 - SECONDS)) "${@:2}"
