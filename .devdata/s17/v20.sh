#!/usr/bin/env bash
# Session 17: issue 29's stage call (q29.sh stage) and, while on the GPU, the branch
# wip/s16-33f's peer-timeout GPU test (its late-flag kernel now loaded before the wait).
# kind nvidia-h200, carry .devdata/s11/w .devdata/s14/d/small .devdata/s16/b, timeout 590.
set -u
bash .devdata/s16/q29.sh stage
ROOT=$PWD; cd .devdata/s16/b
PYTHONPATH=$PWD:/tmp/q29/site timeout 100 python -m pytest -q -m "gpu or not gpu" \
  -p no:cacheprovider tests/kernels/test_tp_peer_timeout.py > $OUT/pytest_timeout.txt 2>&1
echo "timeout tests rc=$? $(tail -1 $OUT/pytest_timeout.txt)"
