#!/usr/bin/env bash
# Session 29 (issue 33, load time): the read-ahead (engine/read_ahead.py) against reading and
# repacking on one thread.
#   ab    (nvidia-h200-x2, carry .devdata/s11/w, timeout 560): build the 70B GPTQ shape, then
#         alternate TP=2 prestarted loads (tools/profile_tp_load.py) with
#         KESTREL_LOAD_READ_AHEAD=0/1, then one-GPU loads 0/1.
#   check (same machine, timeout 590): tools/multigpu_check.py single+tp (greedy, speed,
#         memory) with the read-ahead on; the GPU tests of the TP load.
set -u
[ -d /tmp/site/llguidance ] || pip install -q --no-index --no-deps --target /tmp/site .devdata/s11/w/llguidance*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 KESTREL_TP_PEER_TIMEOUT_S=30
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$SECONDS
M=/tmp/k70/llama3-70b-gptq
brief() {  # load_s and rank 0's read/repack counts of a profile_tp_load json
    python - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
out = {"load_s": d.get("load_s"), "since_t0_s": d.get("since_t0_s")}
ph = d.get("phases")
if isinstance(ph, list) and ph:
    for r, p in enumerate(ph):
        spans = {s[0]: round(s[2] - s[1], 2) for s in p.get("spans", [])}
        out[f"rank{r}"] = {"read_and_cut": spans.get("read and cut shard"),
                           **{k: p.get(k) for k in ("read_s", "repack_s", "cut_s",
                                                     "read_cut_other_s", "stage_wait_s",
                                                     "ahead_s", "ahead_wait_s")}}
print(json.dumps(out))
PY
}
case "${1:-}" in
ab)
    timeout 200 python tools/multigpu_check.py --shape llama3-70b --format gptq --modes \
        --work /tmp/k70 --out /tmp/mgb > /tmp/build.txt 2>&1
    echo "build rc=$? t=$((SECONDS-S))"
    i=0
    for ra in 0 1 0 1; do
        i=$((i+1))
        KESTREL_LOAD_READ_AHEAD=$ra timeout 80 python tools/profile_tp_load.py $M --mode tp \
            --prestart --t0 $(date +%s.%N) --json $OUT/tp-ra$ra-$i.json > $OUT/tp-ra$ra-$i.txt 2>&1
        echo "tp ra=$ra #$i rc=$? t=$((SECONDS-S)) $(brief $OUT/tp-ra$ra-$i.json)"
    done
    for ra in 0 1; do
        KESTREL_LOAD_READ_AHEAD=$ra timeout 60 python tools/profile_tp_load.py $M --mode single \
            --t0 $(date +%s.%N) --json $OUT/single-ra$ra.json > $OUT/single-ra$ra.txt 2>&1
        echo "single ra=$ra rc=$? t=$((SECONDS-S)) $(brief $OUT/single-ra$ra.json)"
    done
    ;;
check)
    timeout 240 python tools/multigpu_check.py --shape llama3-70b --format gptq --modes single tp \
        --work /tmp/k70 --out $OUT/mg > $OUT/mg.txt 2>&1
    echo "70b rc=$? t=$((SECONDS-S))"; grep -E '"(mode|load_s|decode_tok_s|prefill_tok_s|identical|error)"' $OUT/mg/*.json | head -20
    timeout 300 python -m pytest -q -m gpu -p no:cacheprovider -rs tests/engine/test_tensor_parallel.py \
        tests/engine/test_tensor_parallel_cut_load.py tests/engine/test_tensor_parallel_load.py \
        tests/engine/test_tensor_parallel_memory.py tests/loader/test_load_progress.py \
        tests/engine/test_multigpu.py > $OUT/tests.txt 2>&1
    echo "tests rc=$? t=$((SECONDS-S))"; tail -5 $OUT/tests.txt
    ;;
verify)  # after the review's changes: two TP loads, one single, the GPU tests of the load
    timeout 200 python tools/multigpu_check.py --shape llama3-70b --format gptq --modes \
        --work /tmp/k70 --out /tmp/mgb > /tmp/build.txt 2>&1
    echo "build rc=$? t=$((SECONDS-S))"
    for i in 1 2; do
        timeout 80 python tools/profile_tp_load.py $M --mode tp --prestart --t0 $(date +%s.%N) \
            --json $OUT/v-tp-$i.json > $OUT/v-tp-$i.txt 2>&1
        echo "tp #$i rc=$? t=$((SECONDS-S)) $(brief $OUT/v-tp-$i.json)"
    done
    timeout 60 python tools/profile_tp_load.py $M --mode single --t0 $(date +%s.%N) \
        --json $OUT/v-single.json > $OUT/v-single.txt 2>&1
    echo "single rc=$? t=$((SECONDS-S)) $(brief $OUT/v-single.json)"
    timeout 300 python -m pytest -q -m gpu -p no:cacheprovider -rs tests/engine/test_tensor_parallel.py \
        tests/engine/test_tensor_parallel_cut_load.py tests/engine/test_tensor_parallel_load.py \
        tests/engine/test_tensor_parallel_memory.py tests/loader/test_load_progress.py \
        tests/engine/test_multigpu.py tests/engine/test_read_ahead.py > $OUT/tests.txt 2>&1
    echo "tests rc=$? t=$((SECONDS-S))"; tail -5 $OUT/tests.txt
    ;;
p2048)  # the 70B at prompt 2048, one GPU and TP=2 (the prompt slices take rows up to 2048)
    for m in single tp; do
        timeout 240 python tools/multigpu_check.py --shape llama3-70b --format gptq --modes $m \
            --prompt 2048 --greedy 8 --work /tmp/k70 --out $OUT/mg2048 > $OUT/mg2048-$m.txt 2>&1
        echo "70b P2048 $m rc=$? t=$((SECONDS-S))"
    done
    python - <<'PY'
import json, os
out = os.environ["OUT"] + "/mg2048"
s, t = (json.load(open(f"{out}/llama3-70b-gptq-{m}.json")) for m in ("single", "tp"))
for k in ("decode_tok_s", "decode_sync_tok_s", "prefill_tok_s", "load_s"):
    a, b = s.get(k), t.get(k)
    print(k, a, b, round(b / a, 3) if a and b else None)
print("greedy equal:", s.get("greedy_tokens") == t.get("greedy_tokens"), s.get("error"), t.get("error"))
PY
    ;;
*) echo "usage: load.sh ab|check|verify|p2048"; exit 2 ;;
esac
