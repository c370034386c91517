#!/usr/bin/env bash
# Issue 28, session 12 (branch wip/s12-28): RMSNorm folded into the decode GEMVs (o_proj/down
# slot sums add the residual and write sums of squares; qkv/gate_up apply the norm on load).
# Run on ONE H100, cwd = this branch's tree, wip/s11-31's and main's trees beside it:
#   (lead, in /work/main)
#   mkdir -p .devdata/s12/t28 .devdata/s12/t31 .devdata/s12/m28
#   git archive wip/s12-28 | tar -x -C .devdata/s12/t28
#   git archive wip/s11-31 | tar -x -C .devdata/s12/t31
#   git archive main       | tar -x -C .devdata/s12/m28
#   cp /work/wt-28/.devdata/s12/fold28.sh .devdata/s12/t28/
#   run(carry=[".devdata/s12/t28", ".devdata/s12/t31", ".devdata/s12/m28"], timeout_s=320,
#       command="cd .devdata/s12/t28 && S31=$PWD/../t31 MAIN=$PWD/../m28 OUT=$OUT bash fold28.sh")
# (/tmp/site: the wheels the lead installs, put on PYTHONPATH here.)
# BUDGET (s, default 295) bounds the run; steps in priority order, each under `timeout`,
# later ones skipped when the budget is spent:
#   1. tools/bench.py llama3-8b GPTQ P512 decode, kestrel only: branch (builds the model into
#      $WORK first), s31, main; then round 2: branch, s31, main (as the budget allows).
#   2. tools/profile_decode.py (branch): kernels per decode step, fold on (the default).
#   3. tools/determinism_check.py 8B GPTQ (branch): runs bit-identical, PDL on/off.
#   4. pytest -m gpu: test_norm_fold (kernels), test_norm_fold_engine (fold on == off bits,
#      launch count), test_kernel_rms_norm, test_tp_all_reduce (1 GPU parts), test_split_k_sums,
#      test_gate_up_silu, test_determinism.
# Writes $OUT/fold28.json (summary), fold28.log, pytest_gpu.log, bench-*.json, profile.json,
# determinism.json (at most 8 files).
set -u
ROOT=$(pwd)
OUT=${OUT:-$ROOT/.devdata/s12/out}
S31=${S31:-$ROOT/../t31}
MAIN=${MAIN:-$ROOT/../m28}
WORK=${WORK:-/tmp/kestrel-bench-28}
BUDGET=${BUDGET:-295}
TMPO=/tmp/o28
mkdir -p "$OUT" "$TMPO"
export PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
cap() { local t; t=$(left); [ "$t" -gt "$1" ] && t=$1; echo "$t"; }
LOG=$TMPO/fold28.log
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }
save() {
    for f in fold28.json fold28.log pytest_gpu.log bench-branch-1.json bench-s31-1.json \
        bench-main-1.json profile.json determinism.json; do
        [ -f "$TMPO/$f" ] && cp "$TMPO/$f" "$OUT/"
    done
    return 0
}
say "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
for t in "$S31" "$MAIN"; do [ -f "$t/tools/bench.py" ] || say "tree missing: $t"; done

bench() {  # tree label round timeout_s
    local tree=$1 label=$2 round=$3 t=$4
    [ -f "$tree/tools/bench.py" ] || return
    if [ "$t" -lt 35 ]; then say "skip bench $label $round: $t s left"; return; fi
    say "=== bench $label round $round (timeout ${t}s, t=$((SECONDS - START))) ==="
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout "$t" python -m tools.bench \
        --shape llama3-8b --format gptq --prompts 512 --engines kestrel --work "$WORK" \
        --json "$TMPO/bench-$label-$round.json" --plot /tmp/bench-$label-$round.png) \
        > /tmp/bench-$label-$round.log 2>&1
    say "rc=$?"; tail -3 /tmp/bench-$label-$round.log | tee -a "$LOG"; save
}

# 1. decode speed, round 1 (all three trees)
bench "$ROOT" branch 1 "$(cap 120)"
bench "$S31" s31 1 "$(cap 60)"
bench "$MAIN" main 1 "$(cap 60)"

# 1b. norm kernel µs, branch vs s31 (review: the pairwise tree's cost; ~10 s per tree)
for t in "$ROOT" "$S31"; do
    [ "$(left)" -ge 30 ] || break
    PYTHONPATH="$t:/tmp/site" timeout 25 python "$ROOT/.devdata/s12/norm28.py" "$t" 2>&1 \
        | grep NORM28 | tee -a "$LOG"
done

# 2. kernels per step (branch)
T=$(cap 45)
if [ "$T" -ge 25 ]; then
    say "=== profile_decode branch (timeout ${T}s, t=$((SECONDS - START))) ==="
    mkdir -p /tmp/prof28
    PYTHONPATH="$ROOT:/tmp/site" timeout "$T" python tools/profile_decode.py --shape llama3-8b \
        --format gptq --prompt 512 --work "$WORK" --out /tmp/prof28 > /tmp/prof28.log 2>&1
    say "rc=$?"; grep -E "kernels_per_step|graph_replay_ms|step_ms" /tmp/prof28.log | tee -a "$LOG"
    grep -E " us  x" /tmp/prof28.log | head -14 | tee -a "$LOG"
    [ -f /tmp/prof28/profile.json ] && cp /tmp/prof28/profile.json "$TMPO/"; save
fi

# 3. determinism (branch)
T=$(cap 45)
if [ "$T" -ge 25 ]; then
    say "=== determinism_check 8B gptq (timeout ${T}s, t=$((SECONDS - START))) ==="
    PYTHONPATH="$ROOT:/tmp/site" timeout "$T" python -m tools.determinism_check \
        --shape llama3-8b --format gptq --work "$WORK" --runs 6 --steps 32 --prompt 64 \
        --json "$TMPO/determinism.json" > /tmp/determinism.log 2>&1
    say "rc=$?"; grep -v Warning /tmp/determinism.log | tail -6 | tee -a "$LOG"; save
fi

# 4. GPU tests of the touched files
T=$(cap 150)
if [ "$T" -ge 30 ]; then
    say "=== pytest -m gpu (timeout ${T}s, t=$((SECONDS - START))) ==="
    PYTHONPATH="$ROOT:/tmp/site" timeout "$T" python -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels/test_norm_fold.py tests/engine/test_norm_fold_engine.py \
        tests/kernels/test_kernel_rms_norm.py tests/kernels/test_gate_up_silu.py \
        tests/kernels/test_split_k_sums.py tests/engine/test_determinism.py \
        > /tmp/pytest_gpu.log 2>&1
    echo "rc=$?" > /tmp/pytest_gpu.rc
    say "pytest $(cat /tmp/pytest_gpu.rc)"; tail -15 /tmp/pytest_gpu.log | tee -a "$LOG"
    cp /tmp/pytest_gpu.log "$TMPO/"; save
fi

# 5. decode speed, round 2 (as the budget allows; its JSONs stay in the log)
bench "$ROOT" branch 2 "$(cap 45)"
bench "$MAIN" main 2 "$(cap 45)"
bench "$S31" s31 2 "$(cap 45)"

python - "$TMPO" <<'PY' 2>&1 | tee -a "$LOG"
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
summary = {"bench": {}}
for rnd in (1, 2):
    row = {}
    for label in ("branch", "s31", "main"):
        d = load(f"bench-{label}-{rnd}.json")
        if "results" in d:
            r = [r for r in d["results"] if r.get("engine") == "kestrel"][0]
            row[label] = r.get("decode_tok_s")
            row[f"{label}_prefill"] = r.get("prefill_tok_s")
    for other in ("s31", "main"):
        if row.get("branch") and row.get(other):
            row[f"gain_vs_{other}_percent"] = round(100 * (row["branch"] / row[other] - 1), 2)
        if row.get("branch_prefill") and row.get(f"{other}_prefill"):
            row[f"prefill_gain_vs_{other}_percent"] = round(
                100 * (row["branch_prefill"] / row[f"{other}_prefill"] - 1), 2)
    summary["bench"][f"round{rnd}"] = row
p = load("profile.json")
summary["profile"] = {k: p.get(k) for k in ("kernels_per_step", "graph_replay_ms", "step_ms",
                                            "eager_kernel_us_per_step", "error")}
summary["profile"]["top"] = [(k["name"][:60], round(k["us"], 1), k["count"])
                             for k in p.get("kernels", [])[:12]]
summary["determinism"] = load("determinism.json")
try:
    summary["norm_us"] = [json.loads(l.split("NORM28", 1)[1]) for l in open(os.path.join(out, "fold28.log")) if l.startswith("NORM28")]
except Exception as e:
    summary["norm_us"] = f"{type(e).__name__}: {e}"
try:
    summary["pytest_gpu"] = open("/tmp/pytest_gpu.rc").read().strip()
except OSError:
    summary["pytest_gpu"] = "not run"
json.dump(summary, open(os.path.join(out, "fold28.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
say "total $((SECONDS - START)) s"
save
