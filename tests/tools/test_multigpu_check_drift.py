"""tools/multigpu_check.py's summary says whether a mode that parts from the single-GPU
greedy tokens did so at a near tie (rounding) or with logits far apart (a wrong sum)."""

import json
from pathlib import Path

from tools.multigpu_check import summarize


def _write(out: Path, mode: str, tokens: list[int], top2: list[list[float]]) -> None:
    run = {"greedy_tokens": tokens, "greedy_top2": top2, "decode_tok_s": 100.0}
    run["prefill_tok_s"] = 1000.0
    (out / f"m-{mode}.json").write_text(json.dumps(run))


def test_a_mode_that_parts_at_a_near_tie_reports_the_margin_and_the_drift(tmp_path) -> None:
    _write(tmp_path, "single", [5, 7, 9], [[4.0, 1.0], [3.0, 2.5], [2.0, 1.99]])
    _write(tmp_path, "tp", [5, 7, 8], [[4.002, 1.0], [2.997, 2.5], [1.995, 1.994]])
    greedy = summarize(tmp_path, "m")["greedy"]
    assert greedy["single"] == {
        "identical": True,
        "first_divergence": None,
        "max_top1_drift_before": 0.0,
    }
    tp = greedy["tp"]
    assert tp["identical"] is False and tp["first_divergence"] == 2
    # The drift is over the steps where both runs were fed the same tokens (0 and 1).
    assert tp["max_top1_drift_before"] == 0.003
    assert tp["base_margin_at_divergence"] == 0.01


def test_runs_without_top2_still_compare_tokens(tmp_path) -> None:
    for mode, tokens in (("single", [1, 2]), ("split", [1, 3])):
        run = {"greedy_tokens": tokens, "decode_tok_s": 1.0, "prefill_tok_s": 1.0}
        (tmp_path / f"m-{mode}.json").write_text(json.dumps(run))
    greedy = summarize(tmp_path, "m")["greedy"]
    assert greedy["split"] == {"identical": False, "first_divergence": 1}
