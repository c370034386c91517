#!/usr/bin/env bash
# Issue 31, session 11 (branch wip/s11-31): split-K partials in slots + a slot-sum kernel
# after the GEMV. Run on ONE H100, cwd = the branch's tree, main's tree beside it:
#   (lead, in /work/main)
#   mkdir -p .devdata/s11/t31 .devdata/s11/m31
#   git archive wip/s11-31 | tar -x -C .devdata/s11/t31
#   git archive main | tar -x -C .devdata/s11/m31
#   cp /work/wt-31/.devdata/s11/det31.sh /work/wt-31/.devdata/s11/gemv31.py .devdata/s11/t31/
#   run(carry=[".devdata/s11"], timeout_s=330,
#       command="cd .devdata/s11/t31 && MAIN=$PWD/../m31 OUT=$OUT bash det31.sh")
# (/tmp/site: the wheels the lead installs, put on PYTHONPATH here.)
# BUDGET (seconds, default 300) bounds the whole run; steps in priority order, each under
# `timeout`, later ones skipped when the budget is spent:
#   1. tools/bench.py llama3-8b GPTQ P512 decode tok/s, kestrel only: branch (builds the model
#      into $WORK first), then main, same files.
#   2. per-shape GEMV us (gemv31.py): branch (with partials-only / slot-sum-only times) and
#      main, all 32 layers' weights cycled in a CUDA graph; + nondeterministic calls of 30.
#   3. tools/determinism_check.py on the 8B GPTQ (branch): N runs bit-identical, PDL on/off.
#   4. pytest -m gpu: tests/kernels/test_split_k_sums.py tests/engine/test_determinism.py
#      tests/kernels/test_programmatic_launch.py tests/kernels/test_kernel_lora_matmul.py and
#      test_lora_graphs.py's quantized decode in a graph (LoRA's slot, summed after the join)
#   5. if time is left: slot-sum config sweep (branch), then EXL2 bench both trees.
# Writes $OUT/det31.json (the summary, EXL2 and the sweep included), det31.log, pytest_gpu.log,
# bench-{branch,main}-gptq.json, gemv-{branch,main}.json, determinism.json: 8 files.
set -u
ROOT=$(pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$ROOT/.devdata/s11/out}
MAIN=${MAIN:-$ROOT/../m31}
WORK=${WORK:-/tmp/kestrel-bench-31}
BUDGET=${BUDGET:-300}
TMPO=/tmp/o31  # every result; the 8 that come back are copied to $OUT at the end
mkdir -p "$OUT" "$TMPO"
export PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
cap() { local t; t=$(left); [ "$t" -gt "$1" ] && t=$1; echo "$t"; }  # min(left, $1)
LOG=$TMPO/det31.log
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }
save() {  # what has come so far, into $OUT (a run killed by its timeout keeps it)
    for f in det31.json det31.log pytest_gpu.log bench-branch-gptq.json bench-main-gptq.json \
        gemv-branch.json gemv-main.json determinism.json; do
        [ -f "$TMPO/$f" ] && cp "$TMPO/$f" "$OUT/"
    done
    return 0
}
say "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
[ -f "$MAIN/tools/bench.py" ] || say "main's tree is missing at $MAIN"

bench() {  # tree label format timeout_s
    local tree=$1 label=$2 fmt=$3 t=$4
    if [ "$t" -lt 40 ]; then say "skip bench $label $fmt: $t s left"; return; fi
    say "=== bench $label $fmt (timeout ${t}s, t=$((SECONDS - START))) ==="
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout "$t" python -m tools.bench \
        --shape llama3-8b --format "$fmt" --prompts 512 --engines kestrel --work "$WORK" \
        --json "$TMPO/bench-$label-$fmt.json" --plot /tmp/bench-$label-$fmt.png) \
        > /tmp/bench-$label-$fmt.log 2>&1
    say "rc=$?"; tail -4 /tmp/bench-$label-$fmt.log | tee -a "$LOG"; save
}

micro() {  # tree label timeout_s sweep_s
    local tree=$1 label=$2 t=$3 sweep=$4
    if [ "$t" -lt 30 ]; then say "skip gemv $label: $t s left"; return; fi
    say "=== gemv shapes $label (timeout ${t}s, t=$((SECONDS - START))) ==="
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout "$t" python "$HERE/gemv31.py" \
        --work "$WORK" --label "$label" --json "$TMPO/gemv-$label.json" --sweep-seconds "$sweep") \
        2>&1 | grep -v Warning | tail -12 | tee -a "$LOG"; save
}

# 1. decode speed
bench "$ROOT" branch gptq "$(cap 150)"
[ -f "$MAIN/tools/bench.py" ] && bench "$MAIN" main gptq "$(cap 90)"

# 2. per-shape GEMV
micro "$ROOT" branch "$(cap 70)" 0
[ -f "$MAIN/tools/bench.py" ] && micro "$MAIN" main "$(cap 45)" 0

# 3. determinism of the 8B decode (branch)
T=$(cap 70)
if [ "$T" -ge 30 ]; then
    say "=== determinism_check 8B gptq (timeout ${T}s, t=$((SECONDS - START))) ==="
    PYTHONPATH="$ROOT:/tmp/site" timeout "$T" python -m tools.determinism_check \
        --shape llama3-8b --format gptq --work "$WORK" --runs 8 --steps 32 --prompt 64 \
        --json "$TMPO/determinism.json" > /tmp/determinism.log 2>&1
    say "rc=$?"; grep -v Warning /tmp/determinism.log | tail -6 | tee -a "$LOG"; save
fi

# 4. GPU tests
T=$(cap 150)
if [ "$T" -ge 40 ]; then
    say "=== pytest -m gpu (timeout ${T}s, t=$((SECONDS - START))) ==="
    PYTHONPATH="$ROOT:/tmp/site" timeout "$T" python -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels/test_split_k_sums.py tests/engine/test_determinism.py \
        tests/kernels/test_programmatic_launch.py tests/kernels/test_kernel_lora_matmul.py \
        tests/engine/test_lora_graphs.py::test_quantized_decode_lora_in_graph_equals_reference \
        > /tmp/pytest_gpu.log 2>&1
    echo "rc=$?" > /tmp/pytest_gpu.rc
    say "pytest $(cat /tmp/pytest_gpu.rc)"; tail -15 /tmp/pytest_gpu.log | tee -a "$LOG"
    cp /tmp/pytest_gpu.log "$TMPO/"; save
fi

# 5. if time is left: slot-sum sweep, EXL2
T=$(cap 80)
[ "$T" -ge 50 ] && micro "$ROOT" branch-sweep "$T" $((T - 40))
T=$(( $(left) / 2 ))
if [ "$T" -ge 60 ] && [ -f "$MAIN/tools/bench.py" ]; then
    bench "$ROOT" branch exl2 "$T"
    bench "$MAIN" main exl2 "$(left)"
fi

python - "$TMPO" <<'PY' 2>&1 | tee -a "$LOG"
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
def tok(label, fmt):
    d = load(f"bench-{label}-{fmt}.json")
    if "error" in d:
        return d
    r = [r for r in d["results"] if r.get("engine") == "kestrel"][0]
    return {k: r.get(k) for k in ("decode_tok_s", "scheduler_decode_tok_s", "error")}
summary = {}
for fmt in ("gptq", "exl2"):
    runs = {label: tok(label, fmt) for label in ("branch", "main")}
    b, m = runs["branch"].get("decode_tok_s"), runs["main"].get("decode_tok_s")
    if b and m:
        runs["cost_percent"] = round(100 * (1 - b / m), 2)
    summary[fmt] = runs
gb, gm = load("gemv-branch.json"), load("gemv-main.json")
if "shapes" in gb and "shapes" in gm:
    rows = []
    for sb in gb["shapes"]:
        sm = next((s for s in gm["shapes"] if (s["k"], s["n"]) == (sb["k"], sb["n"])), None)
        if sm is None:
            continue
        rows.append({"k": sb["k"], "n": sb["n"], "count": sb["count"], "splits": sb["splits"],
                     "main_us": round(sm["us"], 2), "branch_us": round(sb["us"], 2),
                     "branch_partials_us": round(sb.get("partials_only_us", 0), 2),
                     "slot_sum_alone_us": round(sb.get("slot_sum_only_us", 0), 2),
                     "main_nondet_of_30": sm["nondeterministic_of_30"],
                     "branch_nondet_of_30": sb["nondeterministic_of_30"]})
    summary["gemv"] = {"all_linears_us_main": round(gm["all_linears_us"], 1),
                       "all_linears_us_branch": round(gb["all_linears_us"], 1), "shapes": rows}
sw = load("gemv-branch-sweep.json")
if "shapes" in sw:
    summary["slot_sum_sweep"] = {f'{s["k"]}x{s["n"]}': {"default": s.get("slot_sum_default"),
        "default_us": round(s["us"], 2), **{k: round(v, 2) for k, v in s.get("sweep", {}).items()}}
        for s in sw["shapes"]}
summary["determinism"] = load("determinism.json")
try:
    summary["pytest_gpu"] = open("/tmp/pytest_gpu.rc").read().strip()
except OSError:
    summary["pytest_gpu"] = "not run"
json.dump(summary, open(os.path.join(out, "det31.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
say "total $((SECONDS - START)) s"
save
