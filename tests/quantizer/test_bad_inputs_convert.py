"""Bad command lines and files for convert.py, through its `main()` as a user runs it: each
exits with status 2 and one `convert.py: error:` line naming the flag, file or value, and
leaves no OUT nor OUT.partial behind (argparse's own errors exit 2 through SystemExit)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import convert as cli
from helpers.bad_inputs import cases, copy_model
from helpers.model_factory import make_tiny_llama

SMALL = ["-r", "2", "-l", "64", "-mr", "2", "-ml", "64", "--device", "cpu", "-q"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad-convert") / "fp16"
    make_tiny_llama(path)
    return path


def _run(tiny: Path, work: Path, args: list[str], capsys) -> str:
    """Run convert.py with -i tiny -o work/out plus `args`; returns stderr after checking
    the exit status 2 and that nothing was written."""
    out = work / "out"
    argv = ["-i", str(tiny), "-o", str(out), *SMALL, *args]
    try:
        status = cli.main(argv)
    except SystemExit as e:  # argparse: bad flag values
        status = e.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert not out.exists() and not (work / "out.partial").exists()
    return err


FLAG_CASES = [
    ("bits-not-a-number", ["-b", "four"], r"argument -b/--bits: invalid float value: 'four'"),
    ("bits-missing", [], r"-b/--bits is required"),
    ("bits-nan", ["-b", "nan"], r"bits per weight must lie in 2\.0-8\.0, got nan"),
    ("bits-inf", ["-b", "inf"], r"bits per weight must lie in 2\.0-8\.0, got inf"),
    ("bits-negative", ["-b", "-4"], r"bits per weight must lie in 2\.0-8\.0, got -4\.0"),
    ("bits-zero", ["-b", "0"], r"bits per weight must lie in 2\.0-8\.0, got 0\.0"),
    ("bits-huge", ["-b", "1e300"], r"bits per weight must lie in 2\.0-8\.0, got 1e\+300"),
    ("head-bits-7", ["-b", "4", "-hb", "7"], r"head bits must be one of .*, got 7"),
    ("head-bits-float", ["-b", "4", "-hb", "6.5"], r"argument -hb/--head_bits: invalid int"),
    ("rows-zero", ["-b", "4", "-r", "0"], r"rows must be a positive integer, got 0"),
    ("length-negative", ["-b", "4", "-l", "-64"], r"length must be a positive integer, got -64"),
    ("shard-size-zero", ["-b", "4", "-ss", "0"], r"shard size must be positive, got 0 MB"),
    ("device-nonsense", ["-b", "4", "--device", "tpu"], r"device 'tpu' is not supported"),
    ("damp-zero", ["-b", "4", "-d", "0"], r"damping must lie in \(0, 10\], got 0\.0"),
    ("damp-nan", ["-b", "4", "--damp", "nan"], r"damping must lie in \(0, 10\], got nan"),
    ("damp-text", ["-b", "4", "-d", "high"], r"argument -d/--damp: invalid float value"),
    (
        "shrink-negative",
        ["-b", "4", "--shrink", "-1"],
        r"the Hessian shrinkage must be 'auto' or lie in \[0, 100\], got -1\.0",
    ),
    (
        "shrink-nan",
        ["-b", "4", "--shrink", "nan"],
        r"the Hessian shrinkage must be 'auto' or lie in \[0, 100\], got nan",
    ),
    (
        "shrink-word",
        ["-b", "4", "--shrink", "often"],
        r"argument --shrink: expected auto or a number, got 'often'",
    ),
    ("norm-below-one", ["-b", "4", "--error_norm", "0.5"], r"error norm must lie in 1-16"),
    ("norm-inf", ["-b", "4", "--error_norm", "inf"], r"error norm must lie in 1-16, got inf"),
    ("measure-both-ways", ["-b", "4", "-m", "a.json", "-om", "b.json"], r"either a measurement"),
    (
        "error-reference-other",
        ["-b", "4", "--error_reference", "stream"],
        r"argument --error_reference: invalid choice: 'stream'",
    ),
    (
        "heldout-one",
        ["-b", "4", "--heldout_scoring", "1"],
        r"held-out fraction must lie in \[0, 1\), got 1\.0",
    ),
    ("heldout-negative", ["-b", "4", "--heldout-scoring", "-0.5"], r"\[0, 1\), got -0\.5"),
    ("heldout-nan", ["-b", "4", "--heldout_scoring", "nan"], r"\[0, 1\), got nan"),
    (
        "heldout-text",
        ["-b", "4", "--heldout_scoring", "half"],
        r"argument --heldout_scoring/--heldout-scoring: invalid float value: 'half'",
    ),
    (
        "heldout-one-row",
        ["-b", "4", "-mr", "1", "--heldout_scoring", "0.5"],
        r"held-out scoring needs at least 2 measuring rows \(-mr\), got 1",
    ),
    (
        "heldout-with-reuse",
        ["-b", "4", "-m", "a.json", "--heldout_scoring", "0.5"],
        r"--heldout_scoring and .* choose how a measurement is made; -m reuses one",
    ),
    ("token-power-below-one", ["-b", "4", "--token_power", "0.5"], r"token power must lie in 1-8"),
    (
        "token-power-nan",
        ["-b", "4", "--token-power", "nan"],
        r"token power must lie in 1-8, got nan",
    ),
    (
        "token-power-with-reuse",
        ["-b", "4", "-m", "a.json", "--token_power", "2"],
        r"--token_power choose how a measurement is made; -m reuses one",
    ),
    (
        "reference-with-reuse",
        ["-b", "4", "-m", "a.json", "--error_reference", "module"],
        r"--error_reference, .* choose how a measurement is made",
    ),
]


@cases("args, match", FLAG_CASES)
def test_bad_flags(tiny, tmp_path, capsys, args, match):
    err = _run(tiny, tmp_path, args, capsys)
    assert re.search(match, err), err


def _calibration(tmp_path: Path, content: bytes | None, name: str = "cal.txt") -> Path:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    return path


CALIBRATION_CASES = [
    ("missing", "cal.txt", None, r"cal\.txt"),
    ("empty", "cal.txt", b"", r"cal\.txt.*no text"),
    ("binary", "cal.txt", b"\xff\xfe\x00garbage" * 50, r"cal\.txt.*UTF-8"),
    ("jsonl-broken", "cal.jsonl", b'{"text": "a"}\n{oops\n', r"cal\.jsonl.*line 2"),
    ("jsonl-not-objects", "cal.jsonl", b"[1, 2]\n", r"cal\.jsonl"),
    ("parquet-garbage", "cal.parquet", b"PAR1 not really", r"cal\.parquet"),
    ("unknown-type", "cal.bin", b"\x00\x01", r"cal\.bin.*unsupported type"),
]


@cases("name, content, match", CALIBRATION_CASES)
def test_bad_calibration_file(tiny, tmp_path, capsys, name, content, match):
    cal = _calibration(tmp_path, content, name)
    err = _run(tiny, tmp_path, ["-b", "4", "-c", str(cal)], capsys)
    assert re.search(match, err), err


def test_heldout_scoring_with_one_measuring_row_of_text(tiny, tmp_path, capsys):
    """The calibration text gives one measuring row where two were asked for: held-out
    scoring cannot split it (found after tokenizing; nothing is left behind)."""
    cal = _calibration(tmp_path, ("word " * 20).encode())  # 100 tokens: one row of 64
    err = _run(tiny, tmp_path, ["-b", "4", "-c", str(cal), "--heldout_scoring", "0.5"], capsys)
    assert "held-out scoring needs at least 2 measuring rows" in err and "gives 1 of 64" in err


def test_calibration_is_a_directory(tiny, tmp_path, capsys):
    (tmp_path / "cal.txt").mkdir()
    err = _run(tiny, tmp_path, ["-b", "4", "-c", str(tmp_path / "cal.txt")], capsys)
    assert "convert.py: error:" in err and "cal.txt" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_calibration_unreadable(tiny, tmp_path, capsys):
    cal = _calibration(tmp_path, b"some text " * 200)
    cal.chmod(0)
    err = _run(tiny, tmp_path, ["-b", "4", "-c", str(cal)], capsys)
    assert "cal.txt" in err and "ermission" in err


MEASUREMENT_CASES = [
    ("missing", None, r"m\.json"),
    ("not-json", b"{", r"m\.json"),
    ("a-list", b"[]", r"m\.json"),
    ("other-model", json.dumps({"format": "x", "layers": []}).encode(), r"m\.json"),
]


@cases("content, match", MEASUREMENT_CASES)
def test_bad_measurement_file(tiny, tmp_path, capsys, content, match):
    meas = _calibration(tmp_path, content, "m.json")
    err = _run(tiny, tmp_path, ["-b", "4", "-m", str(meas)], capsys)
    assert "convert.py: error:" in err and re.search(match, err), err


def test_output_inside_the_input_directory(tiny, tmp_path, capsys):
    src = copy_model(tiny, tmp_path / "src")
    for out in (src / "exl2", src / "a" / "b", src):
        try:
            status = cli.main(["-i", str(src), "-o", str(out), "-b", "4", *SMALL])
        except SystemExit as e:
            status = e.code
        err = capsys.readouterr().err
        assert status == 2 and f"output {out} lies inside the input directory {src}" in err, err
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in tiny.iterdir())


@pytest.mark.parametrize("kind", ["missing", "plain-file", "no-config"])
def test_bad_input_path(tmp_path, capsys, kind):
    src = tmp_path / "in"
    if kind == "plain-file":
        src.write_text("hello")
    elif kind == "no-config":
        src.mkdir()
    err = _run(src, tmp_path, ["-b", "4"], capsys)
    want = {
        "missing": "input not found",
        "plain-file": "input must be a model directory or a .gguf file",
        "no-config": "no config.json in",
    }[kind]
    assert want in err and str(src) in err, err


def test_output_is_an_existing_file(tiny, tmp_path, capsys):
    (tmp_path / "out").write_text("precious")
    status = cli.main(["-i", str(tiny), "-o", str(tmp_path / "out"), "-b", "4", *SMALL])
    err = capsys.readouterr().err
    assert status == 2 and f"output {tmp_path / 'out'} already exists" in err, err
    assert (tmp_path / "out").read_text() == "precious"


@pytest.mark.parametrize("key, value", [("hidden_size", -64), ("num_hidden_layers", 10**9)])
def test_bad_model_config(tiny, tmp_path, capsys, key, value):
    src = copy_model(tiny, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, key: value}))
    err = _run(src, tmp_path, ["-b", "4"], capsys)
    assert f"'{key}'" in err and str(src / "config.json") in err, err


def test_nan_weight_stops_the_conversion_with_its_name(tiny, tmp_path, capsys):
    src = copy_model(tiny, tmp_path / "src")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors = load_file(src / "model.safetensors")
    tensors[name][0, 0] = float("nan")
    save_file(tensors, src / "model.safetensors")
    out = tmp_path / "out"
    status = cli.main(["-i", str(src), "-o", str(out), "-b", "4", *SMALL])
    err = capsys.readouterr().err
    assert status == 2 and f"tensor '{name}' in model.safetensors holds 1 NaN" in err, err
    assert not out.exists()
