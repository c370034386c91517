#!/usr/bin/env bash
# Session 26, issue 33 on 2x H200 (kind nvidia-h200-x2, carry .devdata/s11/w, timeout 590).
#   table: test_multigpu.py whole (first TP GPU run since session 18's engine changes), the 70B
#          GPTQ shape whole, P512: one GPU then TP=2 (push all-reduce), then profile_tp_decode
#          on the same 80-layer model (symlinked), tp then single.
#   eight: the 8B shape, single then tp, and its profile (tp, single).
set -u
pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/*.whl > /tmp/pip.log 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:/tmp/site
what=${1:-table}
L=$OUT/v33-$what.log; S=$SECONDS
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > $L
nvidia-smi topo -m >> $L 2>&1
summ() { python - "$@" <<'PY'
import json, sys
for f in sys.argv[1:]:
    try:
        d = json.load(open(f))
    except Exception as e:
        print(f, "unreadable", e); continue
    keys = ("mode", "load_s", "gpu_mem_used_gib", "decode_tok_s", "decode_sync_tok_s", "prefill_tok_s", "tok_s", "sync_tok_s")
    print(f.split("/")[-1], {k: d[k] for k in keys if k in d})
PY
}
prof() {  # shape layers modes...
  local shape=$1 layers=$2; shift 2
  timeout 200 python tools/profile_tp_decode.py --shape $shape --layers $layers --modes "$@" \
    --prompt 512 --steps 32 --work /tmp/kp --out /tmp/prof > /tmp/prof-$shape.txt 2>&1
  echo "profile $shape L$layers $* rc=$? t=$((SECONDS-S))" >> $L
  grep -v Warn /tmp/prof-$shape.txt | tail -45 >> $L
  cp /tmp/prof/tp_profile-*.json $OUT/ 2>/dev/null; rm -f $OUT/*.trace.json
}
if [ "$what" = table ]; then
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_multigpu.py \
    > $OUT/pytest_multigpu.txt 2>&1
  echo "test_multigpu rc=$? $(tail -1 $OUT/pytest_multigpu.txt) t=$((SECONDS-S))" >> $L
  for m in single tp; do
    timeout 200 python tools/multigpu_check.py --shape llama3-70b --format gptq --modes $m \
      --work /tmp/k70 --out $OUT/mg > /tmp/mg-$m.txt 2>&1
    echo "70b $m rc=$? t=$((SECONDS-S))" >> $L; tail -3 /tmp/mg-$m.txt >> $L
  done
  summ $OUT/mg/llama3-70b-gptq-single.json $OUT/mg/llama3-70b-gptq-tp.json >> $L
  python -c "import json;d=json.load(open('$OUT/mg/llama3-70b-gptq-summary.json'));print(json.dumps(d.get('greedy', d))[:600])" >> $L 2>&1
  mkdir -p /tmp/kp && ln -sfn /tmp/k70/llama3-70b-gptq /tmp/kp/llama3-70b-L80-gptq
  [ $((SECONDS-S)) -lt 400 ] && prof llama3-70b 80 tp single
fi
if [ "$what" = eight ]; then
  for m in single tp; do
    timeout 120 python tools/multigpu_check.py --shape llama3-8b --format gptq --modes $m \
      --work /tmp/kmg --out $OUT/mg > /tmp/mg-$m.txt 2>&1
    echo "8b $m rc=$? t=$((SECONDS-S))" >> $L; tail -3 /tmp/mg-$m.txt >> $L
  done
  summ $OUT/mg/llama3-8b-gptq-single.json $OUT/mg/llama3-8b-gptq-tp.json >> $L
  mkdir -p /tmp/kp && ln -sfn /tmp/kmg/llama3-8b-gptq /tmp/kp/llama3-8b-L32-gptq
  prof llama3-8b 32 tp single
fi
# ab: main's TP qkv rope fusion (this tree) against the tree before it (.devdata/s26/base,
#     carried), 70B TP=2, then the profile's critical path by grid, then the GPU tests.
#     carry .devdata/s11/w, .devdata/s26/base; the single-GPU result of call 1 is copied
#     into the results folder first so that the greedy tokens are compared with it.
if [ "$what" = ab ]; then
  mkdir -p $OUT/mg && cp .devdata/s26/single70.json $OUT/mg/llama3-70b-gptq-single.json
  timeout 240 python tools/multigpu_check.py --shape llama3-70b --format gptq --modes tp \
    --work /tmp/k70 --out $OUT/mg > /tmp/mg-tp.txt 2>&1
  echo "70b tp (new) rc=$? t=$((SECONDS-S))" >> $L; tail -2 /tmp/mg-tp.txt >> $L
  (cd .devdata/s26/base && PYTHONPATH=$PWD:/tmp/site timeout 120 python tools/multigpu_check.py \
    --shape llama3-70b --format gptq --modes tp --work /tmp/k70 --out /tmp/mg-base > /tmp/mg-base.txt 2>&1)
  echo "70b tp (base) rc=$? t=$((SECONDS-S))" >> $L; tail -2 /tmp/mg-base.txt >> $L
  summ $OUT/mg/llama3-70b-gptq-tp.json /tmp/mg-base/llama3-70b-gptq-tp.json >> $L
  python -c "import json;d=json.load(open('$OUT/mg/llama3-70b-gptq-summary.json'));print(json.dumps(d.get('greedy', d))[:600])" >> $L 2>&1
  mkdir -p /tmp/kp && ln -sfn /tmp/k70/llama3-70b-gptq /tmp/kp/llama3-70b-L80-gptq
  timeout 150 python tools/profile_tp_decode.py --shape llama3-70b --layers 80 --modes tp \
    --prompt 512 --steps 24 --work /tmp/kp --out /tmp/prof > /tmp/prof.txt 2>&1
  echo "profile tp rc=$? t=$((SECONDS-S))" >> $L; grep -v Warn /tmp/prof.txt | tail -16 >> $L
  python tools/critical_path.py /tmp/prof/tp_profile-llama3-70b-L80-tp.trace.json --by-grid \
    --top 30 --json $OUT/cp-70b-tp.json >> $L 2>&1
  timeout $((570-SECONDS+S)) python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider \
    tests/kernels/test_qkv_rope.py tests/kernels/test_slot_sum_rope.py \
    tests/engine/test_norm_fold_engine.py tests/engine/test_multigpu.py > $OUT/pytest.txt 2>&1
  echo "pytest rc=$? $(tail -1 $OUT/pytest.txt) t=$((SECONDS-S))" >> $L
fi
# rest: the 8B shape single/TP=2 (decode, prefill P512) and the TP profile's critical path;
#       the 70B at P2048 (prefill), one GPU then TP=2; then the 70B's TP load phases warm.
if [ "$what" = rest ]; then
  for m in single tp; do
    timeout 120 python tools/multigpu_check.py --shape llama3-8b --format gptq --modes $m \
      --work /tmp/kmg --out $OUT/mg8 > /tmp/mg8-$m.txt 2>&1
    echo "8b $m rc=$? t=$((SECONDS-S))" >> $L
  done
  summ $OUT/mg8/llama3-8b-gptq-single.json $OUT/mg8/llama3-8b-gptq-tp.json >> $L
  python -c "import json;d=json.load(open('$OUT/mg8/llama3-8b-gptq-summary.json'));print(json.dumps(d.get('greedy', d))[:400])" >> $L 2>&1
  mkdir -p /tmp/kp && ln -sfn /tmp/kmg/llama3-8b-gptq /tmp/kp/llama3-8b-L32-gptq
  timeout 120 python tools/profile_tp_decode.py --shape llama3-8b --layers 32 --modes tp \
    --prompt 512 --steps 32 --work /tmp/kp --out /tmp/prof8 > /tmp/prof8.txt 2>&1
  echo "profile 8b tp rc=$? t=$((SECONDS-S))" >> $L; grep -v Warn /tmp/prof8.txt | tail -14 >> $L
  python tools/critical_path.py /tmp/prof8/tp_profile-llama3-8b-L32-tp.trace.json --by-grid \
    --top 16 >> $L 2>&1
  for m in single tp; do
    timeout 200 python tools/multigpu_check.py --shape llama3-70b --format gptq --modes $m \
      --prompt 2048 --greedy 8 --work /tmp/k70 --out /tmp/mg2048 > /tmp/mg2048-$m.txt 2>&1
    echo "70b P2048 $m rc=$? t=$((SECONDS-S))" >> $L
  done
  summ /tmp/mg2048/llama3-70b-gptq-single.json /tmp/mg2048/llama3-70b-gptq-tp.json >> $L
  cp /tmp/mg2048/llama3-70b-gptq-tp.json $OUT/p2048-tp.json; cp /tmp/mg2048/llama3-70b-gptq-single.json $OUT/p2048-single.json
  if [ $((SECONDS-S)) -lt 480 ]; then
    timeout 90 python tools/profile_tp_load.py /tmp/k70/llama3-70b-gptq --mode tp --prestart \
      --t0 $(date +%s.%N) --json $OUT/load-tp.json > /tmp/load.txt 2>&1
    echo "load tp rc=$? t=$((SECONDS-S))" >> $L; tail -30 /tmp/load.txt >> $L
  fi
fi
# exch: KESTREL_TP_SITE_KERNEL=exchange (o_proj's and down_proj's slot sums exchange the
#       partials, the TP layers fold their norms) against push, 70B TP=2 then 8B, greedy
#       compared with call 1's one-GPU run (copied in); the multi-GPU tests under exchange;
#       the profile's critical path. Stops starting work past 430 s (budget).
if [ "$what" = exch ]; then
  mkdir -p $OUT/mg && cp .devdata/s26/single70.json $OUT/mg/llama3-70b-gptq-single.json
  KESTREL_TP_SITE_KERNEL=exchange timeout 200 python tools/multigpu_check.py --shape llama3-70b \
    --format gptq --modes tp --work /tmp/k70 --out $OUT/mg > /tmp/mg-ex.txt 2>&1
  echo "70b tp exchange rc=$? t=$((SECONDS-S))" >> $L; grep -i "error\|Traceback" /tmp/mg-ex.txt | tail -5 >> $L
  KESTREL_TP_SITE_KERNEL=push timeout 90 python tools/multigpu_check.py --shape llama3-70b \
    --format gptq --modes tp --work /tmp/k70 --out /tmp/mg-push > /tmp/mg-push.txt 2>&1
  echo "70b tp push rc=$? t=$((SECONDS-S))" >> $L
  summ $OUT/mg/llama3-70b-gptq-tp.json /tmp/mg-push/llama3-70b-gptq-tp.json >> $L
  python -c "import json;d=json.load(open('$OUT/mg/llama3-70b-gptq-summary.json'));print(json.dumps(d.get('greedy', d))[:600])" >> $L 2>&1
  if [ $((SECONDS-S)) -lt 330 ]; then
    KESTREL_TP_SITE_KERNEL=exchange timeout 120 python -m pytest -q -m gpu -p no:cacheprovider \
      tests/engine/test_multigpu.py > $OUT/pytest_multigpu_exchange.txt 2>&1
    echo "test_multigpu exchange rc=$? $(tail -1 $OUT/pytest_multigpu_exchange.txt) t=$((SECONDS-S))" >> $L
  fi
  if [ $((SECONDS-S)) -lt 400 ]; then
    mkdir -p /tmp/kp && ln -sfn /tmp/k70/llama3-70b-gptq /tmp/kp/llama3-70b-L80-gptq
    KESTREL_TP_SITE_KERNEL=exchange timeout 70 python tools/profile_tp_decode.py --shape llama3-70b \
      --layers 80 --modes tp --prompt 512 --steps 16 --work /tmp/kp --out /tmp/prof > /tmp/prof.txt 2>&1
    echo "profile tp exchange rc=$? t=$((SECONDS-S))" >> $L; grep -v Warn /tmp/prof.txt | grep "tok/s" >> $L
    python tools/critical_path.py /tmp/prof/tp_profile-llama3-70b-L80-tp.trace.json --by-grid \
      --skip 2 --top 14 >> $L 2>&1
  fi
  if [ $((SECONDS-S)) -lt 430 ]; then
    for k in exchange push; do
      KESTREL_TP_SITE_KERNEL=$k timeout 45 python tools/multigpu_check.py --shape llama3-8b \
        --format gptq --modes tp --work /tmp/kmg --out /tmp/mg8-$k > /tmp/mg8-$k.txt 2>&1
      echo "8b tp $k rc=$? t=$((SECONDS-S))" >> $L
      summ /tmp/mg8-$k/llama3-8b-gptq-tp.json >> $L
    done
  fi
fi
# l2: the GEMV's L2 prefetch (KESTREL_GEMV_L2_PREFETCH=1) against main, 8 layers of the 70B
#     shape, one GPU then TP=2, each with and without; the bitwise GPU test first. Short:
#     the session's last device seconds (stops starting runs past 80 s).
if [ "$what" = l2 ]; then
  timeout 30 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gemv_l2_prefetch.py \
    > /tmp/l2test.txt 2>&1; echo "l2 test rc=$? $(tail -1 /tmp/l2test.txt) t=$((SECONDS-S))" >> $L
  for m in single tp; do
    for v in 0 1; do
      [ $((SECONDS-S)) -gt 80 ] && break 2
      KESTREL_GEMV_L2_PREFETCH=$v timeout 40 python tools/profile_tp_decode.py --shape llama3-70b \
        --layers 8 --modes $m --prompt 512 --steps 16 --work /tmp/kp --out /tmp/p-$m-$v > /tmp/p.txt 2>&1
      echo "$m l2=$v rc=$? t=$((SECONDS-S)) $(grep 'tok/s' /tmp/p.txt)" >> $L
    done
  done
fi
cat $L
