#!/usr/bin/env bash
# Session 18+, after `q29.sh stage` on the same warm machine (models in /tmp/q29/models):
# Gemma-3-270M on the GPU after the float16-range fix, and the dtype tests with a GPU.
# kind nvidia-h200, no carry, timeout 300.
set -u
export PYTHONPATH=$PWD:/tmp/q29/site
timeout 200 python .devdata/s17/gemma_gpu.py /tmp/q29/models/gemma-3-270m-fp16 /tmp/q29/wiki.utf8 \
  $OUT/gemma_gpu.json > $OUT/gemma_gpu.txt 2>&1; echo "gemma_gpu rc=$?"; tail -30 $OUT/gemma_gpu.txt
timeout 80 python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/engine/test_float16_range.py \
  > $OUT/pytest_f16.txt 2>&1; echo "f16 tests rc=$? $(tail -1 $OUT/pytest_f16.txt)"
