#!/usr/bin/env bash
# Session 27, kind nvidia-h200-x4, carry .devdata/s11/w, timeout 595 (issues 28, 33):
#   the GEMV's GPU tests after the L2-prefetch revert, then the 70B GPTQ table row for 4 GPUs:
#   single, tp4, tp (tools/multigpu_check.py, one model build, greedy compared with single).
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/x4.log; S=$SECONDS
nvidia-smi --query-gpu=index,name --format=csv,noheader > $L
nvidia-smi topo -m >> $L 2>&1
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gemv_stages.py tests/kernels/test_gemv_x_words.py tests/kernels/test_quant_matmul_kernels.py \
    tests/kernels/test_qkv_rope.py tests/engine/test_norm_fold_engine.py > $OUT/pytest.txt 2>&1
echo "gpu tests rc=$? $(tail -1 $OUT/pytest.txt) t=$((SECONDS-S))" >> $L
for mode in single tp4 tp; do
    left=$((585-(SECONDS-S)))
    [ $left -lt 60 ] && { echo "no time for $mode" >> $L; break; }
    timeout $left python tools/multigpu_check.py --shape llama3-70b --format gptq --modes $mode \
        --work /tmp/k --out $OUT/mg > /tmp/mg-$mode.txt 2>&1
    echo "70b $mode rc=$? t=$((SECONDS-S))" >> $L; tail -4 /tmp/mg-$mode.txt >> $L
done
cat $L
