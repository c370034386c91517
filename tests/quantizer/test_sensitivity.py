"""engine/quantizer/sensitivity.py: the probe that weighs each module's errors by what its
noise costs at the model's output (issue 29).

The probe's KL of a branch (one module's weights changed, every other layer as it is) is
checked against transformers' own forward of the same checkpoint with the same weights
changed; the conversion records the probe's result, a resumed measurement gets the same
numbers, and the allocation follows the weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from engine.quantizer import ConvertError, ConvertOptions, convert, sensitivity
from engine.quantizer.model import CalibrationRunner, LayerwiseModel, module_specs
from engine.quantizer.sensitivity import (
    SensitivityProbe,
    module_weights,
    probe_shape,
    reference_error,
    reference_profile,
)
from engine.quantizer.strategy import choose_strategy, measurement_slots
from helpers.architectures import CASES
from helpers.model_factory import make_tiny_model

LENGTH = 40


def _noise(w: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.05 * w.abs().mean() * torch.randn(w.shape, generator=g)


def _kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(other.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("case", ["gemma2", "qwen2-tied"])
def test_probe_kl_matches_transformers_with_the_same_weights_changed(tmp_path: Path, case: str):
    """gemma2: soft-capped logits and sandwich norms; qwen2-tied: a head tied to the
    embeddings. Branch by branch, the probe's KL equals transformers' KL of the same change.
    The probe's rows are shorter than the measurement's (its runner keeps the longer RoPE
    tables, as in a conversion)."""
    config_cls, overrides, _ = CASES[case]
    hf = make_tiny_model(tmp_path, config_cls, **overrides)
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (3, LENGTH), generator=torch.Generator().manual_seed(1))

    lm = LayerwiseModel(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    runner = CalibrationRunner(lm, length=LENGTH, chunk_rows=2, rotary_length=3 * LENGTH)
    probe = SensitivityProbe.start(lm.embed(ids))
    changes: list[dict[str, torch.Tensor]] = []  # per branch: {HF parameter: new weight}
    for i in range(lm.num_layers):
        layer = lm.load_layer(i)
        references = {}
        for spec in module_specs(layer):
            weights = {}
            for n, name in enumerate(spec.linears):
                w = layer.get_submodule(name).weight
                weights[name] = w + _noise(w, seed=100 * i + n)
            references[spec.kind] = weights
            changes.append({f"model.layers.{i}.{k}.weight": w for k, w in weights.items()})
        probe.advance(runner, i, references)
        lm.unload_layer(i)
    assert probe.branches == [(i, k) for i in range(lm.num_layers) for k in ("attn", "mlp")]
    costs = probe.costs(lm)

    with torch.no_grad():
        clean = hf(ids).logits
        for branch, change, cost in zip(probe.branches, changes, costs, strict=True):
            changed = copy.deepcopy(hf)
            params = dict(changed.named_parameters())
            for name, w in change.items():
                params[name].data.copy_(w)
            want = _kl(clean, changed(ids).logits)
            assert want > 0
            assert cost == pytest.approx(want, rel=2e-3, abs=1e-9), branch


@pytest.mark.parametrize(
    ("device", "bf16"),
    [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("case", ["gemma2", "qwen2-tied"])
def test_head_passes_in_slices_equal_the_float64_kl_and_take_large_shifts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, device: str, bf16: bool
):
    """The head's KL as a CPU computes it: the vocabulary in slices (7 entries, not a
    divisor of the vocabulary), the branches' shifts through the head in float32 or in
    bf16 (where the CPU multiplies it natively), against float64 KL; and with the head
    scaled 3000x, logit shifts too large for exp in float32, on the direct path; at 1000x
    some rows of a block overflow and only those take it (the others' KL is not checked
    there: logits in the hundreds leave p subnormal, past what the moments are for).
    Blocks of 32 tokens (80 in all: three blocks).
    On a GPU: the whole vocabulary at once, float32."""
    monkeypatch.setattr(sensitivity, "_CPU_VOCAB_SLICE", 7)
    monkeypatch.setattr(sensitivity, "_HEAD_TOKENS", 32)
    if device == "cpu":
        monkeypatch.setattr(sensitivity, "_fast_bf16", lambda device: bf16)
    config_cls, overrides, _ = CASES[case]
    make_tiny_model(tmp_path, config_cls, **overrides)
    lm = LayerwiseModel(tmp_path, device=torch.device(device), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    clean = lm.embed(torch.randint(0, 300, (2, LENGTH), generator=g)).cpu() * 4
    noise = torch.randn(clean.shape, generator=g)
    streams = [clean, clean + 0.02 * noise, clean + 0.3 * noise, clean + 3 * noise]
    norm, head = lm.final_norm(), lm.head_weight()
    cap = getattr(lm.model, "final_logit_softcap", None)

    overflowed: list[int] = []  # rows whose moments were not finite, per branch and block
    recomputed: list[int] = []  # rows the direct path took, per log_softmax call
    moments, log_softmax = sensitivity._kl_of_moments, torch.log_softmax

    def counted_moments(*args: torch.Tensor) -> torch.Tensor:
        kl = moments(*args)
        overflowed.append(int((~torch.isfinite(kl)).sum()))
        return kl

    def counted_log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
        recomputed.append(x.shape[0])
        return log_softmax(x, dim=dim)

    for scale in (1.0, 1000.0, 3000.0):
        scaled = head * scale
        monkeypatch.setattr(lm, "head_weight", lambda scaled=scaled: scaled)

        def log_probs(x: torch.Tensor, scaled: torch.Tensor = scaled) -> torch.Tensor:
            logits = norm(x.to(lm.device)).double() @ scaled.double().T
            logits = logits if cap is None else torch.tanh(logits / cap) * cap
            return torch.log_softmax(logits, dim=-1)

        lp = log_probs(clean)
        want = [float((lp.exp() * (lp - log_probs(x))).sum(-1).mean()) for x in streams[1:]]
        probe = SensitivityProbe(torch.stack(streams), [(0, "attn"), (0, "mlp"), (1, "attn")])
        with monkeypatch.context() as spying:
            spying.setattr(sensitivity, "_kl_of_moments", counted_moments)
            spying.setattr(torch, "log_softmax", counted_log_softmax)
            got = probe.costs(lm)
        if scale == 1000.0:
            continue
        # abs: a GPU's exp rounds to a few ulp, 1e-8 nats of a KL (the smallest here: 1e-5)
        assert got == pytest.approx(want, rel=5e-3 if bf16 else 1e-4, abs=3e-8), scale
    assert cap is not None or want[2] > 1.0  # shifts far past exp's float32 range
    # Two log_softmax calls (p and q) for each branch and block that overflowed, over its
    # overflowed rows alone; only the capped model (|dz| <= 2 cap) never overflows.
    assert recomputed == [n for n in overflowed if n for _ in range(2)]
    assert (cap is None) == (sum(overflowed) > 0)
    assert cap is not None or any(0 < n < 32 for n in overflowed)  # some rows, not all


@pytest.mark.parametrize("case", ["gemma2", "qwen2-tied"])
def test_a_16_bit_model_probes_its_head_in_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
):
    """A measurement in a 16-bit dtype (the GPU's: its streams and the final norm's weight
    in that dtype) still takes the head's norm in float32: a branch enters the head as its
    difference from the clean copy, a few percent of the hidden state for a small change,
    and a norm output rounded to 16 bits first (about 2^-8 of the state in bfloat16) would
    swamp it. Against float64 KL of the very same 16-bit streams, small branches too."""
    monkeypatch.setattr(sensitivity, "_fast_bf16", lambda device: False)
    config_cls, overrides, _ = CASES[case]
    make_tiny_model(tmp_path, config_cls, **overrides)
    lm = LayerwiseModel(tmp_path, device=torch.device("cpu"), dtype=torch.bfloat16)
    norm, head = lm.final_norm(), lm.head_weight()
    assert norm.weight.dtype == torch.bfloat16
    cap = getattr(lm.model, "final_logit_softcap", None)
    g = torch.Generator().manual_seed(4)
    clean = lm.embed(torch.randint(0, 300, (2, LENGTH), generator=g)) * 4
    noise = torch.randn(clean.shape, generator=g)
    streams = [(clean.float() + s * noise).to(torch.bfloat16) for s in (0.0, 0.02, 0.1, 0.5)]
    weight = norm.weight.double() + (1.0 if norm.unit_offset else 0.0)

    def log_probs(x: torch.Tensor) -> torch.Tensor:
        xd = x.double()
        h = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + norm.eps) * weight
        logits = h @ head.double().T
        logits = logits if cap is None else torch.tanh(logits / cap) * cap
        return torch.log_softmax(logits, dim=-1)

    lp = log_probs(streams[0])
    want = [float((lp.exp() * (lp - log_probs(x))).sum(-1).mean()) for x in streams[1:]]
    probe = SensitivityProbe(torch.stack(streams), [(0, "attn"), (0, "mlp"), (1, "attn")])
    got = probe.costs(lm)
    assert min(want) > 0
    assert got == pytest.approx(want, rel=1e-3, abs=1e-9)


def test_the_clean_copy_costs_nothing_and_branches_survive_a_save(tmp_path: Path):
    config_cls, overrides, _ = CASES["qwen2-tied"]
    make_tiny_model(tmp_path, config_cls, **overrides)
    lm = LayerwiseModel(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    runner = CalibrationRunner(lm, length=LENGTH, chunk_rows=4)
    ids = torch.randint(0, 300, (2, LENGTH), generator=torch.Generator().manual_seed(2))
    probe = SensitivityProbe.start(lm.embed(ids))
    layer = lm.load_layer(0)
    same = {
        spec.kind: {name: layer.get_submodule(name).weight.clone() for name in spec.linears}
        for spec in module_specs(layer)
    }
    probe.advance(runner, 0, same)
    assert probe.costs(lm) == pytest.approx([0.0, 0.0], abs=1e-9)

    back = SensitivityProbe.from_tensors(probe.tensors())
    assert back.branches == [(0, "attn"), (0, "mlp")]
    assert torch.equal(back.copies, probe.copies)
    with pytest.raises(ValueError, match="3 probe copies for 1 branches"):
        SensitivityProbe(probe.copies, [(0, "attn")])


def test_the_probe_shape_fits_its_tokens_and_memory():
    """(rows, tokens per row): up to four rows (one per calibration source) holding the
    device's probe tokens, fewer tokens per row when the 2L + 1 copies would pass 1 GiB."""
    small = dict(layers=30, hidden=576, element_bytes=2)
    assert probe_shape(12, 2048, **small, device_type="cuda") == (4, 2048)
    assert probe_shape(8, 512, **small, device_type="cpu") == (4, 512)
    assert probe_shape(8, 512, **small, device_type="cpu", fast=True) == (4, 256)
    assert probe_shape(12, 2048, **small, device_type="cuda", fast=True) == (4, 2048)
    assert probe_shape(2, 512, **small, device_type="cpu") == (2, 512)
    assert probe_shape(4, 40, **small, device_type="cpu") == (4, 40)
    # Llama-3-8B's shape (32 layers, 4096 wide, bfloat16): 65 copies of 4 rows in 1 GiB.
    big = dict(element_bytes=2, device_type="cuda")
    rows, tokens = probe_shape(12, 2048, layers=32, hidden=4096, **big)
    assert (rows, tokens) == (4, 448) and 65 * rows * tokens * 4096 * 2 <= 1 << 30
    # 70B's (80 layers, 8192 wide): 64 tokens a row, and never fewer than 16.
    assert probe_shape(12, 2048, layers=80, hidden=8192, **big) == (4, 64)
    assert probe_shape(12, 2048, layers=400, hidden=16384, **big) == (4, 16)


def _entry(names: list[str], profile: str, err: float) -> dict:
    return {"profiles": dict.fromkeys(names, profile), "err": err}


def test_weights_are_kl_over_the_reference_error_squared_with_a_floor():
    ref = reference_profile()
    entries = [_entry(["qk", "v", "o"], "3b128", 0.2), _entry(["qk", "v", "o"], ref, 0.1)]
    assert reference_error(entries) == 0.1
    with pytest.raises(ValueError, match="no candidate"):
        reference_error(entries[:1])
    sens = [
        {"attn": {"kl": 0.02, "err": 0.1}, "mlp": {"kl": 0.0, "err": 0.1}},
        {"attn": {"kl": 0.08, "err": 0.2}, "mlp": {"kl": 0.5, "err": 0.1}},
    ]
    w = module_weights(sens)
    assert w[0]["attn"] == pytest.approx(2.0) and w[1]["attn"] == pytest.approx(2.0)
    assert w[1]["mlp"] == pytest.approx(50.0)
    assert w[0]["mlp"] == pytest.approx(1e-3 * 2.0)  # floored at a fraction of the median


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sens") / "tiny"
    config_cls, overrides, _ = CASES["qwen2-tied"]
    make_tiny_model(path, config_cls, **overrides)
    return path


def _options(bits: float, **kw) -> ConvertOptions:
    settings = dict(rows=4, length=64, measure_rows=4, measure_length=64, device="cpu")
    return ConvertOptions(bits=bits, **{"progress": False, **settings, **kw})


@pytest.mark.gpu
def test_a_gpu_measurement_probes_like_the_cpu_one(tiny: Path, tmp_path: Path):
    """The probe in a GPU measurement (float32 head, the whole vocabulary at once): a KL
    for every module, within 1.5x of the CPU measurement's (their GPTQ reference weights
    differ by the devices' rounding: 11% apart on this model, H200), and the conversion
    from it finishes."""
    on = {}
    for device in ("cpu", "cuda"):
        path = tmp_path / f"{device}.json"
        options = _options(4.0, measurement_out=path, measure_only=True, device=device)
        convert(tiny, tmp_path / f"m-{device}", options)
        on[device] = json.loads(path.read_text())["sensitivity"]
    for cpu, gpu in zip(on["cpu"], on["cuda"], strict=True):
        for kind in ("attn", "mlp"):
            assert 1 / 1.5 < gpu[kind]["kl"] / cpu[kind]["kl"] < 1.5, kind
    out = tmp_path / "out"
    result = convert(tiny, out, _options(4.0, measurement_in=tmp_path / "cuda.json", device="cuda"))
    assert result.finished and (out / "config.json").is_file()


def test_a_measurement_records_the_probe_and_a_resume_gets_the_same(tiny: Path, tmp_path: Path):
    whole = tmp_path / "whole.json"
    convert(tiny, tmp_path / "a", _options(4.0, measurement_out=whole, measure_only=True))
    record = json.loads(whole.read_text())
    layers = len(record["layers"])
    assert record["scoring"]["sensitivity_rows"] == 4
    assert record["scoring"]["sensitivity_tokens"] == 64
    assert [set(s) for s in record["sensitivity"]] == [{"attn", "mlp"}] * layers
    for i, s in enumerate(record["sensitivity"]):
        for kind, v in s.items():
            assert v["kl"] > 0 and v["err"] == reference_error(record["layers"][i][kind])

    parts = tmp_path / "parts.json"
    opts = _options(4.0, measurement_out=parts, measure_only=True)
    stopped = ConvertOptions(**{**opts.__dict__, "stop_after_layers": 1})
    assert not convert(tiny, tmp_path / "b", stopped).finished
    assert convert(tiny, tmp_path / "b", opts).resumed
    resumed = json.loads(parts.read_text())
    assert resumed["sensitivity"] == record["sensitivity"]
    assert resumed["layers"] == record["layers"]

    # Stopped after the last layer, before the head passes: the resume only probes.
    last = tmp_path / "last.json"
    opts = _options(4.0, measurement_out=last, measure_only=True)
    stopped = ConvertOptions(**{**opts.__dict__, "stop_after_layers": layers})
    assert not convert(tiny, tmp_path / "c", stopped).finished
    job = json.loads((tmp_path / "c.partial" / "job.json").read_text())
    assert len(job["state"]["measurement"]["layers"]) == layers
    assert "sensitivity" not in job["state"]["measurement"]
    result = convert(tiny, tmp_path / "c", opts)
    assert result.resumed and result.measured_now == []
    assert json.loads(last.read_text())["sensitivity"] == record["sensitivity"]


def test_sensitivity_off_measures_without_the_probe_and_kl_needs_one(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    plain = tmp_path / "plain.json"
    off = _options(4.0, measurement_out=plain, measure_only=True, sensitivity="off")
    convert(tiny, tmp_path / "a", off)
    record = json.loads(plain.read_text())
    assert "sensitivity" not in record and "sensitivity_rows" not in record["scoring"]
    assert "sensitivity_tokens" not in record["scoring"]

    # kl (the default) with a measurement made without the probe: said, and as measured.
    capsys.readouterr()
    opts = _options(3.5, measurement_in=plain, progress=True, stop_after_layers=1)
    assert not convert(tiny, tmp_path / "b", opts).finished
    said = capsys.readouterr()
    assert "holds no sensitivity probe" in said.out + said.err
    job = json.loads((tmp_path / "b.partial" / "job.json").read_text())
    lm = LayerwiseModel(tiny, device=torch.device("cpu"), dtype=torch.float32)
    assert job["state"]["strategy"] == choose_strategy(lm, record, 3.5)[0]
    with pytest.raises(ConvertError, match="sensitivity must be one of kl, off, got 'ppl'"):
        convert(tiny, tmp_path / "c", _options(4.0, sensitivity="ppl"))


def test_the_allocation_follows_the_weights(tiny: Path, tmp_path: Path):
    """Errors scaled by √w; a module whose probe says it matters most gets more bits than
    the unweighted allocation gives it."""
    meas = tmp_path / "m.json"
    convert(tiny, tmp_path / "a", _options(4.0, measurement_out=meas, measure_only=True))
    record = json.loads(meas.read_text())
    lm = LayerwiseModel(tiny, device=torch.device("cpu"), dtype=torch.float32)
    plain, _ = measurement_slots(lm, record)
    weighed, _ = measurement_slots(lm, record, sensitivity=True)
    weights = [w for layer in module_weights(record["sensitivity"]) for w in layer.values()]
    for p, q, w in zip(plain, weighed, weights, strict=True):
        assert [b for b, _ in p] == [b for b, _ in q]
        assert [e for _, e in q] == pytest.approx([e * w**0.5 for _, e in p])

    # The first layer's MLP made a thousand times as costly: at no width does it get fewer
    # bits, and at some it gets more.
    louder = copy.deepcopy(record)
    louder["sensitivity"][0]["mlp"]["kl"] *= 1000
    mlp_bits = []
    for bits in (3.75, 4.0, 4.5, 5.0, 6.0):
        before = choose_strategy(lm, record, bits, sensitivity=True)[0][0]["mlp"]
        after = choose_strategy(lm, louder, bits, sensitivity=True)[0][0]["mlp"]
        mlp_bits.append((sum(map(_bits, before.values())), sum(map(_bits, after.values()))))
    assert all(a >= b for b, a in mlp_bits) and any(a > b for b, a in mlp_bits), mlp_bits


def _bits(profile: str) -> float:
    """Mean bits of a profile name ("4b128", "0.4:4b64+0.6:3b64")."""
    total = 0.0
    for part in profile.split("+"):
        fraction, _, rest = part.rpartition(":")
        total += float(fraction or 1.0) * int(rest.split("b")[0])
    return total


def test_a_probe_that_is_not_finite_is_refused_by_name(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A branch whose KL is NaN (activations out of the working dtype's range) stops the
    conversion with a clear error that names the module, and the work stays for a resume."""
    real = SensitivityProbe.costs

    def one_nan(self: SensitivityProbe, lm: LayerwiseModel, tick=None) -> list[float]:
        costs = real(self, lm, tick)
        return [float("nan"), *costs[1:]]

    monkeypatch.setattr(SensitivityProbe, "costs", one_nan)
    opts = _options(4.0, measurement_out=tmp_path / "m.json", measure_only=True)
    with pytest.raises(ConvertError, match=r"not finite for layer 0 attn in torch.float32.*off"):
        convert(tiny, tmp_path / "a", opts)
    assert (tmp_path / "a.partial").is_dir()
    monkeypatch.setattr(SensitivityProbe, "costs", real)
    result = convert(tiny, tmp_path / "a", opts)
    assert result.resumed and result.measured_now == []
    assert "sensitivity" in json.loads((tmp_path / "m.json").read_text())
