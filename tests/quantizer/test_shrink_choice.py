"""The Hessian shrinkage chosen per model (engine/quantizer/shrink_choice.py, convert.py
--shrink auto): the ladder's search, the held-out loss against transformers' own, and a
conversion that keeps the pass it chose, resumes mid-choice, and falls back to plain GPTQ
when the text leaves no rows to hold out."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.quantizer import ConvertOptions, convert
from engine.quantizer.calibration import DATA_DIR, calibration_rows, read_calibration_text
from engine.quantizer.model import CalibrationRunner, LayerwiseModel
from engine.quantizer.shrink_choice import (
    SHRINK_LADDER,
    best_shrink,
    heldout_loss,
    heldout_row_count,
    next_shrink,
)
from engine.tokenizer import Tokenizer
from helpers.architectures import CASES
from helpers.model_factory import make_tiny_llama, make_tiny_model

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
ROWS = dict(rows=4, length=128, measure_rows=2, measure_length=128)


def test_the_ladder_goes_up_only_while_a_rung_helps() -> None:
    assert SHRINK_LADDER == (0.0, 0.3, 1.0)
    assert next_shrink({}) == 0.0
    assert next_shrink({0.0: 2.0}) == 0.3
    assert next_shrink({0.0: 2.0, 0.3: 2.1}) is None  # 0.3 lost: stop at two passes
    assert next_shrink({0.0: 2.0, 0.3: 2.0}) is None  # a tie is no gain
    assert next_shrink({0.0: 2.0, 0.3: 1.9}) == 1.0
    assert next_shrink({0.0: 2.0, 0.3: 1.9, 1.0: 1.8}) is None  # the top rung
    assert best_shrink({0.0: 2.0, 0.3: 1.9, 1.0: 1.95}) == 0.3
    assert best_shrink({0.0: 2.0, 0.3: 2.0}) == 0.0  # ties go to less shrinkage
    assert best_shrink({0.0: math.nan, 0.3: 2.0}) == 0.3  # an overflowed pass loses
    assert best_shrink({0.0: math.inf, 0.3: math.nan}) == 0.0
    with pytest.raises(ValueError, match="no shrinkage"):
        best_shrink({})


def test_heldout_rows_are_an_eighth_and_at_least_4096_tokens() -> None:
    assert heldout_row_count(64, 2048) == 8
    assert heldout_row_count(16, 512) == 8
    assert heldout_row_count(8, 128) == 32
    assert heldout_row_count(256, 2048) == 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "fp"
    make_tiny_llama(path, **SHAPE)
    return path


@pytest.mark.parametrize("case", ["llama", "gemma2"])
def test_heldout_loss_is_transformers_loss(tiny, tmp_path, case) -> None:
    """Unquantized, the loss through the layers, final norm and head equals the reference
    model's own next-token loss on the same rows (gemma2: a 1 + w final norm and soft-capped
    logits)."""
    from transformers import AutoModelForCausalLM

    path = tiny
    if case == "gemma2":
        config_cls, overrides, _ = CASES["gemma2"]
        make_tiny_model(tmp_path, config_cls, **overrides)
        path = tmp_path
    ids = torch.randint(0, 200, (3, 64), generator=torch.Generator().manual_seed(0))
    lm = LayerwiseModel(path, device=torch.device("cpu"), dtype=torch.float32)
    runner = CalibrationRunner(lm, length=ids.shape[1], chunk_rows=2)
    states = lm.embed(ids)
    for i in range(lm.num_layers):
        lm.load_layer(i)
        states = runner.run_layer(i, states)
        lm.unload_layer(i)
    ours = heldout_loss(lm, states, lm.head_weight(), ids)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        reference = float(hf(ids, labels=ids).loss)
    assert ours == pytest.approx(reference, abs=2e-5)
    # A zero head predicts uniformly: log(vocab) whatever the states.
    zero = torch.zeros_like(lm.head_weight())
    assert heldout_loss(lm, states, zero, ids) == pytest.approx(math.log(zero.shape[0]), abs=1e-6)


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """A user's own calibration text, long enough for the quantizing and held-out rows."""
    path = tmp_path_factory.mktemp("text") / "own.txt"
    path.write_text((DATA_DIR / "wiki.utf8").read_text(encoding="utf-8")[:120_000])
    return path


def _options(**kw) -> ConvertOptions:
    return ConvertOptions(bits=4.0, device="cpu", progress=False, **{**ROWS, **kw})


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "output.safetensors")


def _same(a: Path, b: Path) -> bool:
    x, y = _tensors(a), _tensors(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def chosen(tiny, text, tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """(measurement, auto output, lines heard) of one conversion on the user's text."""
    work = tmp_path_factory.mktemp("auto")
    meas = work / "measurement.json"
    convert(tiny, work / "m", _options(calibration=text, measurement_out=meas, measure_only=True))
    heard: list[str] = []
    out = work / "auto"
    result = convert(
        tiny, out, _options(calibration=text, measurement_in=meas, listener=heard.append)
    )
    assert result.finished
    return meas, out, heard


def test_own_text_chooses_among_passes_and_keeps_the_chosen_one(tiny, text, chosen, tmp_path):
    meas, out, heard = chosen
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    shrink, ppl = qc["hessian_shrink"], qc["hessian_shrink_heldout_ppl"]
    assert shrink in SHRINK_LADDER and ppl[f"{shrink:g}"] == min(ppl.values())
    assert set(ppl) in ({"0", "0.3"}, {"0", "0.3", "1"})
    passes = {
        line.split(" (shrinkage ", 1)[1].split(")")[0] for line in heard if "(shrinkage" in line
    }
    assert {"0", "0.3"} <= passes <= {"0", "0.3", "1"}
    # The kept pass is exactly a conversion at that shrinkage alone (same rows, same -m).
    fixed = tmp_path / "fixed"
    convert(tiny, fixed, _options(calibration=text, measurement_in=meas, shrink=shrink))
    assert _same(out, fixed)
    # ... and the default without a text of one's own (the shipped mix) is plain GPTQ.
    mix = tmp_path / "mix"
    convert(tiny, mix, _options(measurement_in=meas))
    assert (
        json.loads((mix / "config.json").read_text())["quantization_config"]["hessian_shrink"]
        == 0.0
    )


def test_the_recorded_perplexity_is_the_written_models_on_the_heldout_rows(tiny, text, chosen):
    """The held-out states went through every quantized layer: the kept pass's recorded
    perplexity is what the written model, loaded as a user loads it, reads on those rows
    (the rows after the quantizing ones; the written norms and embeddings are fp16)."""
    import loader

    _, out, _ = chosen
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    recorded = qc["hessian_shrink_heldout_ppl"][f"{qc['hessian_shrink']:g}"]
    rows = ROWS["rows"]
    heldout = calibration_rows(
        Tokenizer.from_dir(tiny),
        [read_calibration_text(text)],
        rows + heldout_row_count(rows, ROWS["length"]),
        ROWS["length"],
    )[rows:]
    model = loader.load(out, "kestrel", device="cpu")
    nll = [
        torch.nn.functional.cross_entropy(model.logits(row.tolist())[:-1].float(), row[1:])
        for row in heldout
    ]
    assert math.exp(float(torch.stack(nll).mean())) == pytest.approx(recorded, rel=1e-3)


def test_a_job_begun_before_the_choice_resumes_as_it_began(tiny, text, chosen, tmp_path):
    """An OUT.partial whose settings hold no shrinkage (made before `-c` meant auto) resumes
    with the same flags as plain GPTQ instead of failing on a settings mismatch."""
    meas, _, _ = chosen
    out = tmp_path / "old"
    old = _options(calibration=text, measurement_in=meas, shrink=0.0, stop_after_layers=1)
    assert not convert(tiny, out, old).finished
    assert (
        "shrink" not in json.loads((tmp_path / "old.partial" / "job.json").read_text())["settings"]
    )
    resumed = convert(tiny, out, _options(calibration=text, measurement_in=meas))
    assert resumed.finished and resumed.resumed and resumed.quantized_now == [1]
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]["hessian_shrink"]
        == 0.0
    )


def test_a_stopped_choice_resumes_where_it_stood(tiny, text, chosen, tmp_path):
    meas, reference, _ = chosen
    out = tmp_path / "stopped"
    opts = _options(calibration=text, measurement_in=meas)
    layers = 2  # the tiny model's: stop in the second pass, after its first layer
    stopped = convert(
        tiny, out, ConvertOptions(**{**opts.__dict__, "stop_after_layers": layers + 1})
    )
    assert not stopped.finished and stopped.quantized_now == [0, 1, 0]
    job = json.loads((tmp_path / "stopped.partial" / "job.json").read_text())["state"]
    assert set(job["shrink_losses"]) == {"0"} and job["quantized_layers-s0.3"] == 1
    resumed = convert(tiny, out, opts)
    assert resumed.finished and resumed.quantized_now[0] == 1  # layer 0 of 0.3 not redone
    assert _same(out, reference)


@pytest.mark.parametrize("spare_rows", [0, 3])
def test_a_text_with_too_few_rows_to_spare_quantizes_once_at_zero(tiny, tmp_path, spare_rows):
    """4 quantizing rows of 128 tokens, then none or 3 more (384 tokens, fewer than the
    2,048 a choice needs) and a part row."""
    tokenizer = Tokenizer.from_dir(tiny)
    ids = tokenizer.encode(
        (DATA_DIR / "wiki.utf8").read_text(encoding="utf-8")[:40_000], add_bos=False
    )
    short = tmp_path / "short.txt"
    short.write_text(tokenizer.decode(ids[: (4 + spare_rows) * 128 + 60]))
    tokens = len(tokenizer.encode(short.read_text(), add_bos=False))
    assert (4 + spare_rows) * 128 < tokens < (5 + spare_rows) * 128
    out = tmp_path / "out"
    result = convert(tiny, out, _options(calibration=short, shrink="auto"))
    assert result.finished and result.quantized_now == [0, 1]  # one pass
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["hessian_shrink"] == 0.0
