#!/usr/bin/env bash
# Issue 28, next GPU session: issue 28's whole table in back-to-back calls on one warm machine
# (carry [".devdata/s11/w"] on the first; idle release is 30 s, so have the next call ready).
#   bash .devdata/s25/v28.sh 8b   : exllamav2 built, then bench.py GPTQ (P512, P8192) and EXL2
#                                   (P512, P8192), Kestrel and exllamav2
#   bash .devdata/s25/v28.sh 70b  : bench.py 70B GPTQ P512, Kestrel and exllamav2 (the build
#                                   from the first call if the machine stayed warm)
set -u
[ -d /tmp/site/llguidance ] || pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
W=/tmp/exl; S=$SECONDS
if [ ! -f $W/site/exllamav2/attn.py ]; then
    mkdir -p $W/site
    python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site \
        .devdata/s11/w/exllamav2-0.3.2-py3-none-any.whl > $W/pip.txt 2>&1
    sed -i 's/block_diag_layers or causal:/block_diag_layers:/' $W/site/exllamav2/attn.py
fi
export PYTHONPATH=$W/site:$PYTHONPATH TORCH_EXTENSIONS_DIR=$W/ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
timeout 300 python3 -c "import exllamav2, exllamav2.ext" > $OUT/build.txt 2>&1
echo "build rc=$? t=$((SECONDS - S))"
case "${1:-}" in
8b)
    for f in gptq exl2; do
        left=$((580 - (SECONDS - S))); [ $left -lt 60 ] && break
        hb=""; [ $f = exl2 ] && hb="--exl2-head-bits 4"
        timeout $left python3 tools/bench.py --format $f $hb --prompts 512 8192 \
            --engines kestrel exllamav2 --json $OUT/bench-8b-$f.json > $OUT/bench-8b-$f.txt 2>&1
        echo "bench $f rc=$? t=$((SECONDS - S))"; tail -6 $OUT/bench-8b-$f.txt
    done
    ;;
70b)
    timeout $((580 - (SECONDS - S))) python3 tools/bench.py --shape llama3-70b --format gptq \
        --prompts 512 --engines kestrel exllamav2 --json $OUT/bench-70b-gptq.json > $OUT/bench-70b.txt 2>&1
    echo "bench 70b rc=$? t=$((SECONDS - S))"; tail -6 $OUT/bench-70b.txt
    ;;
*) echo "usage: v28.sh 8b|70b"; exit 2 ;;
esac
