#!/usr/bin/env bash
# Issue 31, session 12 (branch wip/s11-31): gate_up's slot sum writes silu(gate) * up; the
# decode GEMV splits K as little as its column tiles allow (gemv_split_iters). Run on ONE
# H100, cwd = the branch's tree, main's tree beside it:
#   (lead, in /work/main)
#   mkdir -p .devdata/s12/t31 .devdata/s12/m31
#   git archive wip/s11-31 | tar -x -C .devdata/s12/t31
#   git archive main | tar -x -C .devdata/s12/m31
#   cp /work/wt-31/.devdata/s12/det31b.sh /work/wt-31/.devdata/s12/gemv31b.py .devdata/s12/t31/
#   run(carry=[".devdata/s12/t31", ".devdata/s12/m31"], timeout_s=320,
#       command="cd .devdata/s12/t31 && MAIN=$PWD/../m31 OUT=$OUT bash det31b.sh")
# (/tmp/site: the wheels the lead installs, put on PYTHONPATH here.)
# BUDGET (seconds, default 295) bounds the whole run; steps in priority order, each under
# `timeout`, later ones skipped when the budget is spent:
#   1. tools/bench.py llama3-8b GPTQ P512 decode tok/s, kestrel only, alternating:
#      branch (builds the model into $WORK first), main, branch, main.
#   2. per-shape GEMV us (gemv31b.py): branch (partials / slot sum alone, gate_up + silu fused
#      vs unfused, the split-K iters sweep) and main (gate_up + silu_mul too).
#   3. tools/determinism_check.py on the 8B GPTQ (branch): runs bit-identical, PDL on/off.
#   4. pytest -m gpu of the touched files' tests.
# Writes $OUT/det31b.json (the summary: both bench rounds, cost_percent per round and of
# the means, per-shape us, the iters sweep, determinism, pytest rc), det31b.log,
# pytest_gpu.log, bench-{branch,main}-gptq-1.json, gemv-{branch,main}.json, determinism.json.
set -u
ROOT=$(pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$ROOT/.devdata/s12/out}
MAIN=${MAIN:-$ROOT/../m31}
WORK=${WORK:-/tmp/kestrel-bench-31}
BUDGET=${BUDGET:-295}
TMPO=/tmp/o31b  # every result; the 8 that come back are copied to $OUT at the end
mkdir -p "$OUT" "$TMPO"
export PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
cap() { local t; t=$(left); [ "$t" -gt "$1" ] && t=$1; echo "$t"; }  # min(left, $1)
LOG=$TMPO/det31b.log
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }
save() {  # what has come so far, into $OUT (a run killed by its timeout keeps it)
    for f in det31b.json det31b.log pytest_gpu.log bench-branch-gptq-1.json \
        bench-main-gptq-1.json gemv-branch.json gemv-main.json determinism.json; do
        [ -f "$TMPO/$f" ] && cp "$TMPO/$f" "$OUT/"
    done
    return 0
}
say "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
[ -f "$MAIN/tools/bench.py" ] || say "main's tree is missing at $MAIN"

bench() {  # tree label round timeout_s
    local tree=$1 label=$2 round=$3 t=$4
    if [ "$t" -lt 35 ]; then say "skip bench $label $round: $t s left"; return; fi
    say "=== bench $label round $round (timeout ${t}s, t=$((SECONDS - START))) ==="
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout "$t" python -m tools.bench \
        --shape llama3-8b --format gptq --prompts 512 --engines kestrel --work "$WORK" \
        --json "$TMPO/bench-$label-gptq-$round.json" --plot /tmp/bench-$label-$round.png) \
        > /tmp/bench-$label-$round.log 2>&1
    say "rc=$?"; tail -3 /tmp/bench-$label-$round.log | tee -a "$LOG"; save
}

micro() {  # tree label timeout_s iters_s
    local tree=$1 label=$2 t=$3 iters=$4
    if [ "$t" -lt 25 ]; then say "skip gemv $label: $t s left"; return; fi
    say "=== gemv shapes $label (timeout ${t}s, t=$((SECONDS - START))) ==="
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout "$t" python "$HERE/gemv31b.py" \
        --work "$WORK" --label "$label" --json "$TMPO/gemv-$label.json" --iters-seconds "$iters") \
        2>&1 | grep -v Warning | tail -16 | tee -a "$LOG"; save
}

# 1. decode speed, alternating
bench "$ROOT" branch 1 "$(cap 120)"
[ -f "$MAIN/tools/bench.py" ] && bench "$MAIN" main 1 "$(cap 70)"
bench "$ROOT" branch 2 "$(cap 70)"
[ -f "$MAIN/tools/bench.py" ] && bench "$MAIN" main 2 "$(cap 70)"

# 2. per-shape GEMV (branch with the iters sweep)
micro "$ROOT" branch "$(cap 60)" 25
[ -f "$MAIN/tools/bench.py" ] && micro "$MAIN" main "$(cap 35)" 0

# 3. determinism of the 8B decode (branch)
T=$(cap 50)
if [ "$T" -ge 25 ]; then
    say "=== determinism_check 8B gptq (timeout ${T}s, t=$((SECONDS - START))) ==="
    PYTHONPATH="$ROOT:/tmp/site" timeout "$T" python -m tools.determinism_check \
        --shape llama3-8b --format gptq --work "$WORK" --runs 6 --steps 32 --prompt 64 \
        --json "$TMPO/determinism.json" > /tmp/determinism.log 2>&1
    say "rc=$?"; grep -v Warning /tmp/determinism.log | tail -6 | tee -a "$LOG"; save
fi

# 4. GPU tests of the touched files
T=$(cap 120)
if [ "$T" -ge 30 ]; then
    say "=== pytest -m gpu (timeout ${T}s, t=$((SECONDS - START))) ==="
    PYTHONPATH="$ROOT:/tmp/site" timeout "$T" python -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels/test_gate_up_silu.py tests/kernels/test_split_k_sums.py \
        tests/kernels/test_kernel_lora_matmul.py tests/kernels/test_kernel_fused_ops.py \
        tests/engine/test_lora_graphs.py::test_quantized_decode_lora_in_graph_equals_reference \
        tests/engine/test_determinism.py > /tmp/pytest_gpu.log 2>&1
    echo "rc=$?" > /tmp/pytest_gpu.rc
    say "pytest $(cat /tmp/pytest_gpu.rc)"; tail -15 /tmp/pytest_gpu.log | tee -a "$LOG"
    cp /tmp/pytest_gpu.log "$TMPO/"; save
fi

python - "$TMPO" <<'PY' 2>&1 | tee -a "$LOG"
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
def tok(label, rnd):
    d = load(f"bench-{label}-gptq-{rnd}.json")
    if "error" in d:
        return d
    r = [r for r in d["results"] if r.get("engine") == "kestrel"][0]
    return {k: r.get(k) for k in ("decode_tok_s", "scheduler_decode_tok_s", "error")}
summary = {"gptq": {}}
means = {}
for rnd in (1, 2):
    runs = {label: tok(label, rnd) for label in ("branch", "main")}
    for key in ("decode_tok_s", "scheduler_decode_tok_s"):
        b, m = runs["branch"].get(key), runs["main"].get(key)
        if b and m:
            runs[f"cost_percent_{key}"] = round(100 * (1 - b / m), 2)
        for label in ("branch", "main"):
            v = runs[label].get(key)
            if v:
                means.setdefault((label, key), []).append(v)
    summary["gptq"][f"round{rnd}"] = runs
for key in ("decode_tok_s", "scheduler_decode_tok_s"):
    b, m = means.get(("branch", key)), means.get(("main", key))
    if b and m:
        bm, mm = sum(b) / len(b), sum(m) / len(m)
        summary["gptq"][f"mean_{key}"] = {"branch": round(bm, 1), "main": round(mm, 1),
                                         "cost_percent": round(100 * (1 - bm / mm), 2)}
gb, gm = load("gemv-branch.json"), load("gemv-main.json")
if "shapes" in gb and "shapes" in gm:
    rows = []
    for sb in gb["shapes"]:
        sm = next((s for s in gm["shapes"] if (s["k"], s["n"]) == (sb["k"], sb["n"])), None)
        if sm is None:
            continue
        row = {"k": sb["k"], "n": sb["n"], "count": sb["count"], "splits": sb["splits"],
               "main_splits": sm["splits"], "main_us": round(sm["us"], 2),
               "branch_us": round(sb["us"], 2),
               "branch_partials_us": round(sb.get("partials_only_us", 0), 2),
               "slot_sum_alone_us": round(sb.get("slot_sum_only_us", 0), 2),
               "main_nondet_of_30": sm["nondeterministic_of_30"],
               "branch_nondet_of_30": sb["nondeterministic_of_30"]}
        for key in ("gate_up_silu_unfused_us", "gate_up_silu_fused_us"):
            if key in sb:
                row["branch_" + key] = round(sb[key], 2)
            if key in sm:
                row["main_" + key] = round(sm[key], 2)
        if "gate_up_silu_fused_equal_bits" in sb:
            row["fused_equal_bits"] = sb["gate_up_silu_fused_equal_bits"]
        if sb.get("iters_sweep"):
            row["iters_sweep"] = {i: [v["splits"], v["programs"], round(v["us"], 2), v["tag"]]
                                  for i, v in sb["iters_sweep"].items()}
        rows.append(row)
    summary["gemv"] = {"all_linears_us_main": round(gm["all_linears_us"], 1),
                       "all_linears_us_branch": round(gb["all_linears_us"], 1),
                       "gemv_registers": gb.get("gemv_registers"), "shapes": rows}
summary["determinism"] = load("determinism.json")
try:
    summary["pytest_gpu"] = open("/tmp/pytest_gpu.rc").read().strip()
except OSError:
    summary["pytest_gpu"] = "not run"
json.dump(summary, open(os.path.join(out, "det31b.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
say "total $((SECONDS - START)) s"
save
