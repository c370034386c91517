#!/usr/bin/env bash
# Issue 28, session 13 (branch wip/s13-28, "t28b"): RMSNorm folded into the decode GEMVs with
# no norm work in the GEMV: o_proj/down_proj slot sums add the residual and write the sums of
# squares and xw = h * w; qkv/gate_up read xw as x and their slot sums apply rstd, then bias.
# Compares against wip/s11-31 ("t31", deterministic slot sums, no fold) and main ("m").
#
# HOW TO RUN (lead, in /work/main; ONE H100; about 200 s of wall time):
#   rm -rf .devdata/s13/t28b .devdata/s13/t31 .devdata/s13/m
#   mkdir -p .devdata/s13/t28b .devdata/s13/t31 .devdata/s13/m
#   git archive wip/s13-28 | tar -x -C .devdata/s13/t28b
#   git archive wip/s11-31 | tar -x -C .devdata/s13/t31
#   git archive main       | tar -x -C .devdata/s13/m
#   run(carry=[".devdata/s13/t28b", ".devdata/s13/t31", ".devdata/s13/m"], timeout_s=230,
#       command="cd .devdata/s13/t28b && S31=$PWD/../t31 MAIN=$PWD/../m OUT=$OUT bash .devdata/s13/fold28b.sh")
# (The script is force-added to the branch, so git archive brings it along. /tmp/site, if
# the lead installed wheels there, goes on PYTHONPATH; nothing here needs them.)
#
# BUDGET (s, default 195) bounds the whole run; steps in priority order, each under
# `timeout`, later ones skipped when the budget is spent (the log says which):
#   1. tools/bench.py llama3-8b GPTQ P512, kestrel only, 2 interleaved rounds: t28b (builds
#      the model into $WORK first), t31, m, then t28b, t31, m.
#   2. tools/profile_decode.py on t28b: kernels_per_step, GEMV and slot-sum us per step.
#   3. pytest -m gpu of the fold's tests (timeout 150 s at most): tests/kernels/test_norm_fold.py,
#      tests/engine/test_norm_fold_engine.py (fold vs unfused tokens/logits, same bits every
#      run with PDL on/off, launch count).
# SKIP="bench2 profile tests" (any of bench1 bench2 profile tests) skips steps.
# Writes $OUT/fold28b.json (summary), fold28b.log, pytest_gpu.log, bench-*-1.json, profile.json.
set -u
ROOT=$(pwd)
OUT=${OUT:-$ROOT/.devdata/s13/out}
S31=${S31:-$ROOT/../t31}
MAIN=${MAIN:-$ROOT/../m}
WORK=${WORK:-/tmp/kestrel-bench-28b}
BUDGET=${BUDGET:-195}
SKIP=${SKIP:-}
TMPO=/tmp/o28b
mkdir -p "$OUT" "$TMPO"
export PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
cap() { local t; t=$(left); [ "$t" -gt "$1" ] && t=$1; echo "$t"; }
skipped() { case " $SKIP " in *" $1 "*) return 0 ;; esac; return 1; }
LOG=$TMPO/fold28b.log
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }
save() {
    for f in fold28b.json fold28b.log pytest_gpu.log bench-t28b-1.json bench-t31-1.json \
        bench-m-1.json profile.json; do
        [ -f "$TMPO/$f" ] && cp "$TMPO/$f" "$OUT/"
    done
    return 0
}
say "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
say "t28b: $ROOT  t31: $S31  m: $MAIN  budget ${BUDGET}s"
for t in "$S31" "$MAIN"; do [ -f "$t/tools/bench.py" ] || say "tree missing: $t"; done

bench() {  # tree label round timeout_s
    local tree=$1 label=$2 round=$3 t=$4
    [ -f "$tree/tools/bench.py" ] || return 0
    if [ "$t" -lt 25 ]; then say "skip bench $label $round: $t s left"; return 0; fi
    say "=== bench $label round $round (timeout ${t}s, t=$((SECONDS - START))) ==="
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout "$t" python -m tools.bench \
        --shape llama3-8b --format gptq --prompts 512 --engines kestrel --work "$WORK" \
        --json "$TMPO/bench-$label-$round.json" --plot "/tmp/bench-$label-$round.png") \
        > "/tmp/bench-$label-$round.log" 2>&1
    say "rc=$?"; tail -3 "/tmp/bench-$label-$round.log" | tee -a "$LOG"; save
}

# 1. decode speed, 2 interleaved rounds (the first t28b run builds the model: longer cap)
if ! skipped bench1; then
    bench "$ROOT" t28b 1 "$(cap 75)"
    bench "$S31" t31 1 "$(cap 35)"
    bench "$MAIN" m 1 "$(cap 35)"
fi
if ! skipped bench2; then
    bench "$ROOT" t28b 2 "$(cap 30)"
    bench "$S31" t31 2 "$(cap 30)"
    bench "$MAIN" m 2 "$(cap 30)"
fi

# 2. kernels per step and GEMV us (t28b)
T=$(cap 45)
if ! skipped profile && [ "$T" -ge 25 ]; then
    say "=== profile_decode t28b (timeout ${T}s, t=$((SECONDS - START))) ==="
    mkdir -p /tmp/prof28b
    PYTHONPATH="$ROOT:/tmp/site" timeout "$T" python tools/profile_decode.py --shape llama3-8b \
        --format gptq --prompt 512 --work "$WORK" --out /tmp/prof28b > /tmp/prof28b.log 2>&1
    say "rc=$?"; grep -E "kernels_per_step|graph_replay_ms|step_ms" /tmp/prof28b.log | tee -a "$LOG"
    grep -E " us  x" /tmp/prof28b.log | head -14 | tee -a "$LOG"
    [ -f /tmp/prof28b/profile.json ] && cp /tmp/prof28b/profile.json "$TMPO/"; save
else
    say "skip profile ($T s left)"
fi

# 3. the fold's GPU tests
T=$(cap 150)
if ! skipped tests && [ "$T" -ge 30 ]; then
    say "=== pytest -m gpu (timeout ${T}s, t=$((SECONDS - START))) ==="
    PYTHONPATH="$ROOT:/tmp/site" timeout "$T" python -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels/test_norm_fold.py tests/engine/test_norm_fold_engine.py \
        > "$TMPO/pytest_gpu.log" 2>&1
    echo "rc=$?" > /tmp/pytest_gpu28b.rc
    say "pytest $(cat /tmp/pytest_gpu28b.rc)"; tail -15 "$TMPO/pytest_gpu.log" | tee -a "$LOG"; save
else
    say "skip tests ($T s left)"
fi

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
    for label in ("t28b", "t31", "m"):
        d = load(f"bench-{label}-{rnd}.json")
        if "results" in d:
            r = [r for r in d["results"] if r.get("engine") == "kestrel"][0]
            row[label] = r.get("decode_tok_s")
    for other in ("t31", "m"):
        if row.get("t28b") and row.get(other):
            row[f"t28b_vs_{other}_percent"] = round(100 * (row["t28b"] / row[other] - 1), 2)
    summary["bench"][f"round{rnd}"] = row
p = load("profile.json")
kernels = p.get("kernels", [])
summary["profile"] = {k: p.get(k) for k in ("kernels_per_step", "graph_replay_ms", "step_ms",
                                            "eager_kernel_us_per_step", "error")}
for key, part in (("gemv_us_per_step", "gemv_kernel"), ("slot_sum_us_per_step", "slot_sum")):
    summary["profile"][key] = round(sum(k["us"] for k in kernels if part in k["name"]), 1)
summary["profile"]["top"] = [(k["name"][:60], round(k["us"], 1), k["count"]) for k in kernels[:12]]
try:
    summary["pytest_gpu"] = open("/tmp/pytest_gpu28b.rc").read().strip()
except OSError:
    summary["pytest_gpu"] = "not run"
json.dump(summary, open(os.path.join(out, "fold28b.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
say "total $((SECONDS - START)) s"
save
