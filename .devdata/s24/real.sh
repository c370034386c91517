#!/usr/bin/env bash
# Issue 29, session 24, CPU: the user's path with the new default: convert.py -c on the
# shared English text measures and quantizes with --shrink 0.3 (no patch, no saved
# measurement), 4.0 bpw; perplexity 16 windows beside the patched quantize-only result.
set -u
cd /work/main
M=/work/models/SmolLM2-135M-Instruct-fp16
D=/tmp/d29/s24
S=$SECONDS
.venv/bin/python convert.py -i $M -o $D/real-sh4 -b 4.0 -c /tmp/d29/shared.txt --device cpu \
    -om $D/real-sh4-meas.json > $D/real-sh4-meas.log 2>&1
echo "measure rc=$? $((SECONDS-S)) s" >> $D/progress3.txt
.venv/bin/python convert.py -i $M -o $D/real-sh4 -b 4.0 -c /tmp/d29/shared.txt --device cpu \
    -m $D/real-sh4-meas.json > $D/real-sh4.log 2>&1
echo "quantize rc=$? $((SECONDS-S)) s" >> $D/progress3.txt
.venv/bin/python tools/perplexity.py -m $D/real-sh4 --domains --windows 16 --device cpu \
    > $D/ppl-real.log 2>&1
echo "ppl rc=$? $((SECONDS-S)) s" >> $D/progress3.txt
