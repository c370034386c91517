"""How the measurement scores candidates (engine/quantizer/measure.py): the stream each
module's error is divided by (error_reference), the rows the GPTQ Hessians and the
scores come from (heldout) and the power mean over tokens (token_power), on one layer of a
tiny random model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.quantizer.capture import capture_layer
from engine.quantizer.measure import measure_layer, scoring_rows
from engine.quantizer.model import CalibrationRunner, LayerwiseModel, mid_stream_path
from helpers.architectures import CASES
from helpers.model_factory import make_tiny_llama, make_tiny_model

HIDDEN, LENGTH = 64, 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("measure-scoring")
    make_tiny_llama(path, hidden_size=HIDDEN, intermediate_size=128)
    return path


def _rows(count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _errors(record: dict, kind: str) -> torch.Tensor:
    return torch.tensor([e["err"] for e in record[kind]], dtype=torch.float64)


def _measure(lm: LayerwiseModel, states: torch.Tensor, **kw) -> tuple[torch.Tensor, dict]:
    runner = CalibrationRunner(lm, length=LENGTH, chunk_rows=2)
    return measure_layer(runner, 0, states, **kw)


def test_scoring_rows() -> None:
    assert scoring_rows(12, 2048) == (12, 12)
    assert scoring_rows(12, 2048, heldout=0.5) == (6, 6)
    assert scoring_rows(12, 2048, heldout=0.25) == (9, 3)
    assert scoring_rows(2, 64, heldout=0.99) == (1, 1)  # one row each, whatever the fraction
    assert scoring_rows(2, 64, heldout=0.01) == (1, 1)
    assert scoring_rows(8, 512, score_tokens=1024) == (8, 2)
    assert scoring_rows(8, 512, heldout=0.75, score_tokens=1024) == (2, 2)
    with pytest.raises(ValueError, match="at least 2 measuring rows"):
        scoring_rows(1, 64, heldout=0.5)
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="held-out fraction"):
            scoring_rows(8, 64, heldout=bad)


@pytest.mark.parametrize("case", ["llama", "gemma2", "gemma3", "phi3-partial-rotary", "qwen3"])
@torch.inference_mode()
def test_mid_stream_is_the_stream_after_the_attention(tmp_path: Path, case: str) -> None:
    """With the MLP's output linear zeroed, the layer's output is the stream right after
    the attention (Gemma's post-feedforward norm of zero is zero): what `mid_stream_path`'s
    input must be, whatever norms the architecture puts around its attention."""
    if case == "llama":
        make_tiny_llama(tmp_path)
    else:
        config_cls, overrides, _ = CASES[case]
        make_tiny_model(tmp_path, config_cls, **overrides)
    lm = LayerwiseModel(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    runner = CalibrationRunner(lm, length=16, chunk_rows=2)
    layer = lm.load_layer(0)
    states = torch.randn(3, 16, lm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    mid = mid_stream_path(layer)
    _, cap = capture_layer(runner, 0, states, inputs=[mid])
    layer.get_submodule(f"{getattr(layer, 'mlp_name', 'mlp')}.down_proj").weight.zero_()
    out, _ = capture_layer(runner, 0, states)
    assert out is not None and not torch.equal(out, states)
    torch.testing.assert_close(cap.inputs[mid], out, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_module_reference_judges_the_attention_by_the_stream_it_writes_into(tiny) -> None:
    """Layer reference: an MLP that writes 50x more into the stream makes the attention's
    errors look far smaller. Module reference: the attention's errors do not depend on
    the MLP after it, and the MLP's are the layer reference's (its stream is the layer's
    output either way)."""
    lm = LayerwiseModel(tiny, device=torch.device("cpu"), dtype=torch.float32)
    states = _rows(3, 0)
    records = {}
    for loud in (False, True):
        layer = lm.load_layer(0)
        if loud:
            layer.mlp.down_proj.weight.mul_(50.0)
        for ref in ("layer", "module"):
            records[loud, ref] = _measure(lm, states, error_reference=ref)[1]
        lm.unload_layer(0)

    quiet_layer, loud_layer = (
        _errors(records[False, "layer"], "attn"),
        _errors(records[True, "layer"], "attn"),
    )
    assert bool((loud_layer < quiet_layer / 5).all()), (quiet_layer, loud_layer)
    torch.testing.assert_close(
        _errors(records[True, "module"], "attn"), _errors(records[False, "module"], "attn")
    )
    # The stream after the attention is smaller than after the whole layer here: larger
    # relative errors than the layer reference gives.
    assert bool((_errors(records[False, "module"], "attn") > quiet_layer).all())
    for loud in (False, True):
        assert records[loud, "module"]["mlp"] == records[loud, "layer"]["mlp"]
        assert [e["profiles"] for e in records[loud, "module"]["attn"]] == [
            e["profiles"] for e in records[loud, "layer"]["attn"]
        ]
    with pytest.raises(ValueError, match="error reference must be one of layer, module"):
        _measure(lm, states, error_reference="stream")


@torch.inference_mode()
def test_heldout_scores_rows_the_hessians_did_not_see(tiny) -> None:
    """Rows a, b, c (one each). Held out, [a; b] fits the Hessians on a and scores b:
    - [a; a; b] with a third held out fits on a twice (the same Hessian up to scale, which
      GPTQ ignores) and scores b: the same errors; a Hessian that took in b would differ.
    - [c; b] fits on c and scores b: other errors; a Hessian from b alone would not.
    - in-sample [a; b] scores both on a Hessian of both: other errors.
    The layer output is the in-sample one: the split changes no state fed forward."""
    lm = LayerwiseModel(tiny, device=torch.device("cpu"), dtype=torch.float32)
    lm.load_layer(0)
    a, b, c = _rows(1, 1), _rows(1, 2), _rows(1, 3)
    out, held = _measure(lm, torch.cat([a, b]), heldout=0.5)
    _, twice = _measure(lm, torch.cat([a, a, b]), heldout=1 / 3)
    _, other = _measure(lm, torch.cat([c, b]), heldout=0.5)
    out_in, inside = _measure(lm, torch.cat([a, b]))
    torch.testing.assert_close(out, out_in)
    for kind in ("attn", "mlp"):
        base = _errors(held, kind)
        torch.testing.assert_close(_errors(twice, kind), base, rtol=2e-3, atol=0)
        for changed in (other, inside):
            diff = ((_errors(changed, kind) - base).abs() / base).max()
            assert diff > 2e-2, (kind, float(diff))
    # In-sample optimism: fitted and scored on the same rows, the cheapest candidates look
    # better than on rows the Hessian did not see (the same rows b are scored in `held`
    # and among those of `inside`; here the mean over all candidates).
    assert float(_errors(inside, "mlp").mean()) < float(_errors(held, "mlp").mean())


def test_token_power_weighs_the_worst_tokens_more(tiny) -> None:
    """Power 1 is the mean (the default's errors exactly); a higher power's root of the
    power mean is at least the mean's, strictly here (the tokens' errors differ), and the
    GPTQ results (the candidates) are the same either way."""
    lm = LayerwiseModel(tiny, device=torch.device("cpu"), dtype=torch.float32)
    lm.load_layer(0)
    states = _rows(4, seed=5)
    _, mean = _measure(lm, states)
    _, one = _measure(lm, states, token_power=1.0)
    _, four = _measure(lm, states, token_power=4.0)
    for kind in ("attn", "mlp"):
        assert torch.equal(_errors(one, kind), _errors(mean, kind))
        assert [e["profiles"] for e in four[kind]] == [e["profiles"] for e in mean[kind]]
        assert bool((_errors(four, kind) > _errors(mean, kind)).all())
    with pytest.raises(ValueError, match="token power must be at least 1"):
        _measure(lm, states, token_power=0.5)
