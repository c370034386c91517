"""tools/compare_converters.py with Kestrel's converter alone (exllamav2 needs CUDA): the
shared calibration reaches convert.py as the file asked for, flags meant for the quantizing
calls reach them and not the measurement, the table is written and a rerun reuses it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers.model_factory import CORPUS, make_tiny_llama
from tools import compare_converters
from tools.compare_converters import (
    _exllamav2_run_names,
    _kestrel_shared_file,
    main,
    median_row,
    parse_args,
)

SMALL = ["--rows", "2", "--length", "64", "--measure-rows", "2", "--measure-length", "64"]


def test_shared_file_is_the_text_unless_parquet_is_asked(tmp_path: Path) -> None:
    txt, pq = tmp_path / "shared.txt", tmp_path / "shared.parquet"
    txt.write_text("text")
    assert _kestrel_shared_file("text", txt, pq) == txt
    assert _kestrel_shared_file("parquet", None, None) is None  # no shared calibration
    with pytest.raises(SystemExit, match="needs pandas and pyarrow"):
        _kestrel_shared_file("parquet", txt, pq)  # the parquet could not be written
    pq.write_bytes(b"PAR1")
    assert _kestrel_shared_file("parquet", txt, pq) == pq


def test_median_row_of_exllamav2_runs() -> None:
    # Session 27's four runs of exllamav2's shared SmolLM2 4.0 conversion (H200), two domains.
    runs = [
        {"code": 6.955, "multilingual": 43.974},
        {"code": 7.493, "multilingual": 44.740},
        {"code": 6.996, "multilingual": 45.433},
        {"code": 7.092, "multilingual": 46.456},
    ]
    got = median_row(runs)
    assert got == pytest.approx(
        {"code": (6.996 + 7.092) / 2, "multilingual": (44.740 + 45.433) / 2}
    )
    assert median_row(runs[:3]) == {"code": 6.996, "multilingual": 44.740}
    with pytest.raises(ValueError, match="different domains"):
        median_row([{"code": 1.0}, {"wiki": 1.0}])
    with pytest.raises(ValueError, match="no runs"):
        median_row([])


def test_exllamav2_runs_keep_the_one_run_names_first() -> None:
    one = _exllamav2_run_names("shared", 4.0, 1)
    assert one == [("exllamav2 shared 4", "exllamav2-shared-4", "exllamav2-shared-measurement")]
    three = _exllamav2_run_names("shared", 4.0, 3)
    assert three[0] == one[0]  # a one-run table's row and folder are the first run
    assert [n[1] for n in three] == [
        "exllamav2-shared-4", "exllamav2-shared-4-run2", "exllamav2-shared-4-run3"]  # fmt: skip
    assert [n[2] for n in three][1:] == [
        "exllamav2-shared-measurement-run2", "exllamav2-shared-measurement-run3"]  # fmt: skip
    assert len({n[0] for n in three}) == 3
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--work", "w", "--exllamav2-runs", "0"])


def _linear_weights(model_dir: Path) -> dict:
    tensors = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return {k: v for k, v in tensors.items() if k.endswith(".q_weight")}


def test_kestrel_run_writes_the_table_and_routes_quantize_flags(tmp_path: Path) -> None:
    model = tmp_path / "fp"
    make_tiny_llama(model)
    shared = tmp_path / "wiki.txt"
    shared.write_text("\n\n".join(CORPUS * 4), encoding="utf-8")
    common = ["--model", str(model), "--kestrel-bits", "4", "--calibrations", "shared",
              "--shared-text", str(shared), "--cal-fraction", "1.0", "--window", "32",
              "--windows", "1", "--domains", "wiki", "code", "--device", "cpu", *SMALL]  # fmt: skip
    damped, plain = tmp_path / "damped", tmp_path / "plain"
    table = tmp_path / "damped.json"
    argv = [*common, "--work", str(damped), "--json", str(table),
            "--kestrel-quantize-args=--damp=0.5"]  # fmt: skip
    assert main(argv) == 0
    assert main([*common, "--work", str(plain), "--json", str(tmp_path / "plain.json")]) == 0

    rows = json.loads(table.read_text())["rows"]
    assert set(rows) == {"fp16", "kestrel shared 4"}
    for row in rows.values():
        assert set(row["ppl"]) == {"wiki", "code"}
        assert all(math.isfinite(v) and v > 1 for v in row["ppl"].values())
    config = json.loads((damped / "kestrel-shared-4" / "config.json").read_text())
    assert config["quantization_config"]["calibration"]["dataset"] == "shared-calibration.txt"
    # How the output was made rides along: a text this short leaves too few held-out
    # tokens for --shrink auto to choose by, so plain GPTQ.
    assert (
        rows["kestrel shared 4"]["hessian_shrink"] == 0.0 and "hessian_shrink" not in rows["fp16"]
    )

    # The damping went to the quantizing call alone: the two measurements agree, the
    # quantized weights do not.
    def measured(work: Path) -> list:
        return json.loads((work / "kestrel-shared-measurement.json").read_text())["layers"]

    assert measured(damped) == measured(plain)
    a = _linear_weights(damped / "kestrel-shared-4")
    b = _linear_weights(plain / "kestrel-shared-4")
    assert a.keys() == b.keys() and a
    assert any(not a[k].equal(b[k]) for k in a)

    # A rerun finds every output done and leaves the table as it was.
    before = table.read_text()
    assert main(argv) == 0
    assert json.loads(table.read_text())["rows"] == json.loads(before)["rows"]


def test_exllamav2_runs_make_rows_and_a_median_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--exllamav2-runs with Kestrel's converter standing in for exllamav2's (which needs
    CUDA): each run converts from scratch into a folder and measurement of its own, a
    one-run table's row is the first run, a rerun converts nothing it has scored, and the
    median row takes the runs' figures; runs scored with other windows are refused."""
    model = tmp_path / "fp"
    make_tiny_llama(model)
    shared = tmp_path / "wiki.txt"
    shared.write_text("\n\n".join(CORPUS * 4), encoding="utf-8")
    converted: list[tuple[str, str]] = []

    def convert(src: Path, out: Path, bits: float, meas: Path, cal: Path | None, a) -> float | None:
        converted.append((out.name, meas.name))
        assert cal is not None and cal.name == "shared-calibration.parquet"
        text = cal.with_suffix(".txt")  # the same text (no pyarrow here to write the parquet)
        return compare_converters._kestrel(src, out, bits, meas, text, a)

    monkeypatch.setattr(compare_converters, "_exllamav2", convert)
    table, work = tmp_path / "runs.json", tmp_path / "work"
    common = ["--model", str(model), "--kestrel-bits", "--exllamav2-bits", "3.5",
              "--calibrations", "shared", "--shared-text", str(shared), "--cal-fraction", "1.0",
              "--window", "32", "--domains", "wiki", "code", "--device", "cpu", *SMALL,
              "--work", str(work), "--json", str(table)]  # fmt: skip
    assert main([*common, "--windows", "1"]) == 0
    assert converted == [("exllamav2-shared-3.5", "exllamav2-shared-measurement.json")]
    assert main([*common, "--windows", "1", "--exllamav2-runs", "3"]) == 0
    assert converted[1:] == [
        ("exllamav2-shared-3.5-run2", "exllamav2-shared-measurement-run2.json"),
        ("exllamav2-shared-3.5-run3", "exllamav2-shared-measurement-run3.json"),
    ]
    rows = json.loads(table.read_text())["rows"]
    labels = ["exllamav2 shared 3.5", "exllamav2 shared 3.5 run 2", "exllamav2 shared 3.5 run 3"]
    assert set(rows) == {"fp16", *labels, "exllamav2 shared 3.5 median"}
    median = rows["exllamav2 shared 3.5 median"]
    assert median["runs"] == labels
    for domain in ("wiki", "code"):
        figures = sorted(rows[label]["ppl"][domain] for label in labels)
        assert median["ppl"][domain] == figures[1]
    assert median["bpw"] == sorted(rows[label]["bpw"] for label in labels)[1]

    assert main([*common, "--windows", "1", "--exllamav2-runs", "3"]) == 0
    assert len(converted) == 3  # every run scored already: nothing converted again
    # A width's log is named after its folder (not "exllamav2-shared-3.log" for 3.5).
    assert (work / "exllamav2-shared-3.5-run2.log").is_file()
    assert (work / "exllamav2-shared-3.5.log").is_file()
    with pytest.raises(SystemExit, match="different --window/--windows"):
        main([*common, "--windows", "2", "--exllamav2-runs", "4"])
