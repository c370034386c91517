#!/usr/bin/env bash
# Session 18: main's single-GPU kernel/engine GPU tests again (v22's 200 s cut them off after
# 33 passed), then single vs TP=2 greedy on the 8B, now built seeded (v22 parted at token 3;
# the embedding was unseeded, so each machine drew another model), with each step's top-2
# logits: was a parting a near tie?  kind nvidia-h200-x2, carry .devdata/s11/w, timeout 590.
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:/tmp/site
L=$OUT/v23.log; S=$SECONDS
nvidia-smi --query-gpu=index,name --format=csv,noheader > $L
GPU_TESTS="tests/kernels/test_norm_fold.py tests/engine/test_norm_fold_engine.py
  tests/kernels/test_split_k_sums.py tests/kernels/test_programmatic_launch.py
  tests/kernels/test_slot_sum_rope.py tests/kernels/test_gate_up_silu.py tests/engine/test_determinism.py
  tests/kernels/test_kernel_paged_attention.py tests/kernels/test_kv_cache_types.py"
CUDA_VISIBLE_DEVICES=0 timeout 330 python -m pytest -q -m gpu -p no:cacheprovider --durations=8 $GPU_TESTS \
  > $OUT/pytest_gpu.txt 2>&1
echo "pytest gpu rc=$? $(grep -E 'passed|failed' $OUT/pytest_gpu.txt | tail -1) t=$((SECONDS-S))" >> $L
rm -rf /tmp/kmg
for i in 1 2; do
  for m in single tp; do
    [ $((SECONDS-S)) -gt 510 ] && break 2
    timeout 90 python tools/multigpu_check.py --shape llama3-8b --format gptq --modes $m \
      --work /tmp/kmg --out $OUT/mg > $OUT/mg-$m-$i.txt 2>&1
    echo "$m-$i rc=$? t=$((SECONDS-S))" >> $L
    cp $OUT/mg/llama3-8b-gptq-$m.json $OUT/mg/$m-$i.json 2>/dev/null
    python -c "import json; r=json.load(open('$OUT/mg/llama3-8b-gptq-summary.json')); print(' ', json.dumps(r['greedy']), r['speed'].get('$m',{}).get('decode_tok_s'))" >> $L 2>&1
  done
done
cat $L
