#!/usr/bin/env bash
# Session 18: main's GPU tests after s17's kernels/engine changes that ran on the CPU only
# (the slots kernel removed from the TP all-reduce; Gemma's dtype choice), on 2x H200:
# the single-GPU kernel/engine GPU tests on GPU 0, the float16-range tests, the peer timeout
# test, the whole test_multigpu.py (push), then greedy single vs TP=2 on the 8B four times
# (the 1-in-8 divergence seen in s17), with decode speed.
# kind nvidia-h200-x2, carry .devdata/s11/w, timeout 590.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:/tmp/site
L=$OUT/v22.log; S=$SECONDS
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > $L
git log --oneline -1 >> $L 2>/dev/null
GPU_TESTS="tests/kernels/test_norm_fold.py tests/engine/test_norm_fold_engine.py
  tests/kernels/test_split_k_sums.py tests/kernels/test_programmatic_launch.py
  tests/kernels/test_slot_sum_rope.py tests/kernels/test_gate_up_silu.py tests/engine/test_determinism.py
  tests/kernels/test_kernel_paged_attention.py tests/kernels/test_kv_cache_types.py"
CUDA_VISIBLE_DEVICES=0 timeout 200 python -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS \
  > $OUT/pytest_gpu.txt 2>&1
echo "pytest gpu rc=$? $(tail -1 $OUT/pytest_gpu.txt) t=$((SECONDS-S))" >> $L
timeout 100 python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/engine/test_float16_range.py \
  tests/kernels/test_tp_peer_timeout.py > $OUT/pytest_f16_timeout.txt 2>&1
echo "f16+timeout rc=$? $(tail -1 $OUT/pytest_f16_timeout.txt) t=$((SECONDS-S))" >> $L
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_multigpu.py \
  > $OUT/pytest_multigpu.txt 2>&1
echo "test_multigpu rc=$? $(tail -1 $OUT/pytest_multigpu.txt) t=$((SECONDS-S))" >> $L
tok() { python - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); print(r["greedy_tokens"][:40], round(r["decode_tok_s"], 1))
PY
}
for i in 1 2 3 4; do
  for m in single tp; do
    [ $((SECONDS-S)) -gt 500 ] && break 2
    timeout 80 python tools/multigpu_check.py --shape llama3-8b --format gptq --modes $m \
      --work /tmp/kmg --out $OUT/mg > $OUT/mg-$m-$i.txt 2>&1
    echo "$m-$i rc=$? t=$((SECONDS-S))" >> $L
    cp $OUT/mg/llama3-8b-gptq-$m.json $OUT/mg/$m-$i.json 2>/dev/null && echo "  $(tok $OUT/mg/$m-$i.json)" >> $L
  done
done
cat $L
