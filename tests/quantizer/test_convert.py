"""The EXL2 quantizer (convert.py, engine/quantizer) on a tiny Llama, end to end on CPU.

One measured 4.0-bpw conversion (stopped after its first layer and resumed, so the
measurement's resume is covered too) is shared; the others reuse its measurement (-m), so
they run only the quantization pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import loader
from engine.quant.exl2 import Exl2Tensors, dequantize_exl2
from engine.quant.exl2_writer import fit_exl2_scales, quantize_rtn_exl2
from engine.quantizer import ConvertError, ConvertOptions, convert
from engine.quantizer.calibration import DATA_DIR
from engine.quantizer.gptq import (
    fit_scales,
    gptq_quantize,
    output_error,
    prepare_hessian,
    rtn_factors,
)
from engine.quantizer.optimize import allocate
from engine.quantizer.profiles import HEAD_PROFILES, LADDER
from helpers.model_factory import make_tiny_llama

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
# Small calibration: the shipped default text, a few rows of 128 tokens.
ROWS = dict(rows=8, length=128, measure_rows=4, measure_length=128)
PARTS = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _options(bits: float, **kw) -> ConvertOptions:
    return ConvertOptions(bits=bits, device="cpu", progress=False, **{**ROWS, **kw})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "fp"
    make_tiny_llama(path, **SHAPE)
    return path


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory) -> tuple[Path, Path]:
    """(EXL2 4.0-bpw output, its measurement file), made in two calls: stop, resume."""
    work = tmp_path_factory.mktemp("conv")
    out, meas = work / "exl2-4.0", work / "measurement.json"
    opts = _options(4.0, measurement_out=meas)
    first = convert(tiny, out, ConvertOptions(**{**opts.__dict__, "stop_after_layers": 1}))
    assert not first.finished and first.measured_now == [0]
    assert not out.exists() and (work / "exl2-4.0.partial" / "job.json").is_file()
    second = convert(tiny, out, opts)
    assert second.finished and second.resumed
    assert second.measured_now == [1], "the measured layer was measured again"
    assert not (work / "exl2-4.0.partial").exists()
    return out, meas


def _achieved_bpw(out: Path, src: Path) -> float:
    q = load_file(out / "output.safetensors")
    fp = load_file(src / "model.safetensors")
    bits = sum(
        t.numel() * t.element_size() * 8
        for name, t in q.items()
        if name.startswith("model.layers.") and name.rsplit(".", 1)[-1] in PARTS
    )
    numel = sum(
        fp[f"model.layers.{i}.{m}.{lin}.weight"].numel()
        for i in range(2)
        for m, lins in (("self_attn", LINEARS[:4]), ("mlp", LINEARS[4:]))
        for lin in lins
    )
    return bits / numel


def test_converts_end_to_end_and_generates(converted, tiny):
    out, _ = converted
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "output.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "exl2" and qc["bits"] == 4.0 and qc["head_bits"] == 6
    assert qc["calibration"]["rows"] == 8 and qc["calibration"]["length"] == 128
    assert "dataset" in qc["calibration"] and "version" in qc
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert abs(_achieved_bpw(out, tiny) - 4.0) <= 0.01
    tensors = load_file(out / "output.safetensors")
    assert "lm_head.q_weight" in tensors and "model.layers.1.mlp.down_proj.q_weight" in tensors
    assert tensors["model.embed_tokens.weight"].dtype == torch.float16

    model = loader.load(out, "kestrel", device="cpu")
    text = model.generate("The quick brown fox", {"max_new_tokens": 8, "temperature": 0})
    assert isinstance(text, str) and text


def test_other_width_from_saved_measurement(converted, tiny, tmp_path):
    _, meas = converted
    out = tmp_path / "exl2-3.0"
    result = convert(tiny, out, _options(3.0, measurement_in=meas))
    assert result.finished and result.measured_now == []
    assert abs(_achieved_bpw(out, tiny) - 3.0) <= 0.01
    assert loader.load(out, "kestrel", device="cpu").logits([5, 6, 7]).shape[0] == 3


def _rtn_twin(q_dir: Path, src: Path, dst: Path) -> None:
    """The same model, groups and permutation with round-to-nearest codes."""
    q = load_file(q_dir / "output.safetensors")
    fp = load_file(src / "model.safetensors")
    twin = {k: v for k, v in q.items() if k.rsplit(".", 1)[-1] not in PARTS}
    for name in [k[: -len(".q_weight")] for k in q if k.endswith(".q_weight")]:
        ex = Exl2Tensors.from_dict(q, name + ".")
        groups = ex.groups()
        # A tied head is quantized from the embeddings.
        weight = fp.get(name + ".weight", fp.get("model.embed_tokens.weight"))
        rtn = quantize_rtn_exl2(
            weight,
            [g.bits for g in groups],
            [g.row_end - g.row_start for g in groups],
            perm=torch.argsort(ex.q_invperm.long()),
        )
        twin.update({f"{name}.{k}": v for k, v in rtn.items()})
    dst.mkdir()
    for f in q_dir.iterdir():
        if f.name != "output.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(twin, dst / "output.safetensors")


def test_gptq_beats_rtn_on_model_output(converted, tiny, tmp_path):
    out, _ = converted
    _rtn_twin(out, tiny, tmp_path / "rtn")
    fp = loader.load(tiny, "kestrel", device="cpu")
    # Text like the calibration's, from a part of the default set it did not use.
    text = (DATA_DIR / "tinystories.utf8").read_text(encoding="utf-8")[-3000:]
    ids = fp.encode(text, add_bos=False)[:250]
    ref = fp.logits(ids)
    errs = {}
    for label, path in (("gptq", out), ("rtn", tmp_path / "rtn")):
        logits = loader.load(path, "kestrel", device="cpu").logits(ids)
        errs[label] = float((logits - ref).norm() / ref.norm())
    assert errs["gptq"] < errs["rtn"], errs


def test_gptq_beats_rtn_per_linear():
    torch.manual_seed(0)
    k, n = 256, 96
    mix = torch.randn(k, k) / k**0.5 + torch.eye(k)  # correlated inputs, as activations are
    x = (torch.randn(2048, k) * torch.rand(k) * 3) @ mix
    weight = torch.randn(n, k) * 0.05
    hessian = x.t() @ x
    perm, upper = prepare_hessian(hessian)
    for profile in (LADDER[0], LADDER[2], LADDER[4]):
        result = gptq_quantize(weight, perm, upper, profile, scale_search="fast")
        bits, sizes = profile.layout(k)
        rtn = quantize_rtn_exl2(weight, bits, sizes, perm=perm)
        rtn_w = dequantize_exl2(Exl2Tensors.from_dict(rtn), out_features=n).t()
        gptq_err = output_error(weight, result.dequantized, hessian)
        assert gptq_err < 0.9 * output_error(weight, rtn_w, hessian), profile.name
        packed = result.pack()  # checked against dequantize_exl2 inside
        assert sum(t.numel() * t.element_size() * 8 for t in packed.values()) == (
            profile.storage_bits(k, n)
        )


def test_rtn_mode_is_round_to_nearest():
    """convert.py --rtn's factors turn GPTQ into plain rounding on the same scale grid."""
    torch.manual_seed(1)
    k, n = 128, 64
    weight = torch.randn(n, k) * 0.05
    for profile in (LADDER[0], LADDER[3]):
        result = gptq_quantize(weight, *rtn_factors(k), profile, scale_search="fast")
        bits, sizes = profile.layout(k)
        rtn = quantize_rtn_exl2(weight, bits, sizes, perm=torch.arange(k))
        rtn_w = dequantize_exl2(Exl2Tensors.from_dict(rtn), out_features=n).t()
        torch.testing.assert_close(result.dequantized, rtn_w.float(), rtol=0, atol=1e-3)


def test_rtn_conversion_runs_no_calibration(converted, tiny, tmp_path):
    """--rtn codes depend on the weights alone: no hidden states are computed or kept (a
    stopped job has none to resume from), and a resumed job finishes the rest."""
    _, meas = converted
    out = tmp_path / "rtn"
    stopped = convert(tiny, out, _options(4.0, measurement_in=meas, rtn=True, stop_after_layers=1))
    assert not stopped.finished and stopped.quantized_now == [0]
    assert not (tmp_path / "rtn.partial" / "states").exists()
    done = convert(tiny, out, _options(4.0, measurement_in=meas, rtn=True))
    assert done.finished and done.resumed and done.quantized_now == [1]
    assert abs(_achieved_bpw(out, tiny) - 4.0) <= 0.01
    assert loader.load(out, "kestrel", device="cpu").logits([5, 6, 7]).shape[0] == 3


def test_resume_skips_finished_layers(converted, tiny, tmp_path):
    out_ref, meas = converted
    out = tmp_path / "resumed"
    stopped = convert(tiny, out, _options(4.0, measurement_in=meas, stop_after_layers=1))
    assert not stopped.finished and stopped.quantized_now == [0] and not out.exists()
    job = json.loads((tmp_path / "resumed.partial" / "job.json").read_text())
    assert job["state"]["quantized_layers"] == 1
    with pytest.raises(ConvertError, match="-nr"):
        convert(tiny, out, _options(3.0, measurement_in=meas))
    resumed = convert(tiny, out, _options(4.0, measurement_in=meas))
    assert resumed.finished and resumed.resumed and resumed.quantized_now == [1]
    # Deterministic: the resumed output equals the uninterrupted one.
    a, b = load_file(out / "output.safetensors"), load_file(out_ref / "output.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_converts_a_gguf_file(converted, tmp_path):
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    from helpers.gguf import write_tiny_llama_gguf

    make_tiny_llama(tmp_path / "hf", dtype=torch.float16, tie_word_embeddings=True, **SHAPE)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    gguf = tmp_path / "tiny.F16.gguf"
    write_tiny_llama_gguf(hf, tmp_path / "hf" / "tokenizer.json", gguf)
    out = tmp_path / "from-gguf"
    # Same shapes as the shared model, so its measurement serves (only shapes are checked).
    result = convert(gguf, out, _options(4.0, measurement_in=converted[1]))
    assert result.finished and _no_output(tmp_path / "nothing")
    assert not (tmp_path / "from-gguf.partial").exists()
    assert abs(_achieved_bpw(out, tmp_path / "hf") - 4.0) <= 0.01
    # It loads and runs: four tokens, EOS banned. (A random tiny model's tokens may decode to
    # no text at all, so the text is not what this checks.)
    model = loader.load(out, "kestrel", device="cpu")
    try:
        settings = {"max_new_tokens": 4, "ban_eos_token": True}
        chunks = list(model.stream("Once", settings))
    finally:
        model.unload()
    assert sum(len(c.token_ids) for c in chunks) == 4
    assert chunks[-1].finish_reason == "length"


def _no_output(out: Path) -> bool:
    return not out.exists() and not out.with_name(out.name + ".partial").exists()


@pytest.mark.parametrize("bits", [1.5, 9.0, 2.0])
def test_bits_out_of_range(tiny, tmp_path, bits):
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match="bpw|bits per weight"):
        convert(tiny, out, _options(bits))
    assert _no_output(out)


def test_bad_inputs(tiny, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match="not found"):
        convert(tmp_path / "missing", out, _options(4.0))
    with pytest.raises(ConvertError, match="head bits"):
        convert(tiny, out, _options(4.0, head_bits=7))
    for arch, why in (("FooForCausalLM", "supported:"), ("MixtralForCausalLM", "MoE")):
        odd = tmp_path / arch
        odd.mkdir()
        config = json.loads((tiny / "config.json").read_text())
        (odd / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
        with pytest.raises(ConvertError, match=why) as err:
            convert(odd, out, _options(4.0))
        assert "LlamaForCausalLM" in str(err.value)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file")
    with pytest.raises(ConvertError, match="not a GGUF"):
        convert(fake, out, _options(4.0))
    assert _no_output(out)


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("empty.txt", b"  \n", "no text"),
        ("bad.jsonl", b'{"text": "ok"}\nnot json\n', "line 2"),
        ("nofield.jsonl", b'{"body": "x"}\n', '"text"'),
        ("latin1.txt", "caf\xe9".encode("latin-1"), "UTF-8"),
        ("data.csv", b"a,b\n", "unsupported type"),
        ("bad.parquet", b"PAR1 garbage", "parquet|pyarrow"),
        ("short.txt", b"just a few words", "fewer than one row"),
    ],
)
def test_bad_calibration(tiny, tmp_path, name, content, match):
    cal = tmp_path / name
    cal.write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match=match):
        convert(tiny, out, _options(4.0, calibration=cal))
    assert _no_output(out)


def test_cli_reports_errors(tiny, tmp_path, capsys):
    import convert as cli

    out = tmp_path / "out"
    assert cli.main(["-i", str(tiny), "-o", str(out), "-b", "9", "-q"]) == 2
    assert "2.0-8.0" in capsys.readouterr().err and _no_output(out)


def test_cli_measure_only_then_reuse(tiny, tmp_path):
    import convert as cli

    meas, work, out = tmp_path / "m.json", tmp_path / "work", tmp_path / "out"
    small = ["-r", "4", "-l", "128", "-mr", "2", "-ml", "128", "--device", "cpu", "-q"]
    # -om measures and stops, as exllamav2's does: no -b needed, no model written.
    assert cli.main(["-i", str(tiny), "-o", str(work), "-om", str(meas), *small]) == 0
    assert json.loads(meas.read_text())["format"] and _no_output(work)
    assert cli.main(["-i", str(tiny), "-o", str(out), "-b", "3.5", "-m", str(meas), *small]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 3.5


def test_fast_scale_fit_matches_converter_fit():
    torch.manual_seed(1)
    for bits in (2, 3, 4, 5, 6, 8):
        x = torch.randn(64, 200) * torch.rand(200)
        ref, fast = fit_exl2_scales(x, bits), fit_scales(x, bits, "fast")
        assert torch.equal(ref[0], fast[0]) and torch.equal(ref[2], fast[2])
        assert torch.equal(ref[1], fast[1])


@pytest.mark.parametrize("norm", [2.0, 1.0, 3.5])
def test_allocation_is_optimal_under_budget(norm):
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(50):
        slots = [
            [(rng.randint(1, 60), rng.random()) for _ in range(rng.randint(1, 4))]
            for _ in range(rng.randint(1, 4))
        ]
        low = sum(min(b for b, _ in s) for s in slots)
        budget = rng.randint(low, low + 100)
        choice = allocate(slots, budget, resolution=budget, norm=norm)
        cost = sum(slots[s][j][0] for s, j in enumerate(choice))
        value = sum(slots[s][j][1] ** norm for s, j in enumerate(choice))
        best = min(
            sum(slots[s][j][1] ** norm for s, j in enumerate(c))
            for c in itertools.product(*(range(len(s)) for s in slots))
            if sum(slots[s][j][0] for s, j in enumerate(c)) <= budget
        )
        assert cost <= budget and value == pytest.approx(best)


def test_a_higher_error_norm_evens_out_the_errors():
    # One bit to give: to A (errors 0.45 and 0.5, Σ² 0.4525) or to B (0.6 and 0, Σ² 0.36).
    # The noise power (norm 2) wants B; norm 4 the smaller largest error, A.
    slots = [[(1, 0.6), (2, 0.45)], [(1, 0.5), (2, 0.0)]]
    assert allocate(slots, 3, resolution=3) == [0, 1]
    assert allocate(slots, 3, resolution=3, norm=4.0) == [1, 0]
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="error norm"):
            allocate(slots, 3, norm=bad)


def test_error_norm_and_damp_reach_the_conversion(converted, tiny, tmp_path):
    """The strategy a conversion records is the one its error norm chooses (at a width
    where norms 2 and 16 choose differently), and the options are in its settings."""
    from engine.quantizer.model import LayerwiseModel
    from engine.quantizer.strategy import choose_strategy

    _, meas = converted
    measurement = json.loads(meas.read_text())
    lm = LayerwiseModel(tiny, device=torch.device("cpu"), dtype=torch.float32)
    widths = [b / 4 for b in range(12, 32)]  # 3.0-7.75: the tiny shapes need 2.73 at least
    bits = next(
        b
        for b in widths
        if choose_strategy(lm, measurement, b, sensitivity=True)[0]
        != choose_strategy(lm, measurement, b, error_norm=16.0, sensitivity=True)[0]
    )
    out = tmp_path / "norm16"
    opts = _options(
        bits, measurement_in=meas, error_norm=16.0, damp=0.25, shrink=0.5, stop_after_layers=1
    )
    assert not convert(tiny, out, opts).finished
    job = json.loads((tmp_path / "norm16.partial" / "job.json").read_text())
    chosen = choose_strategy(lm, measurement, bits, error_norm=16.0, sensitivity=True)
    assert job["state"]["strategy"] == chosen[0]
    assert job["settings"]["error_norm"] == 16.0 and job["settings"]["damp"] == 0.25
    assert job["settings"]["shrink"] == 0.5


def _first_layer_measurement(tiny: Path, out: Path, **kw) -> dict:
    """The job of a measurement stopped after layer 0: {"settings", "state"}."""
    opts = _options(4.0, measurement_out=out.with_suffix(".json"), measure_only=True, **kw)
    assert not convert(
        tiny, out, ConvertOptions(**{**opts.__dict__, "stop_after_layers": 1})
    ).finished
    return json.loads((out.with_name(out.name + ".partial") / "job.json").read_text())


def test_error_reference_and_heldout_reach_the_measurement(converted, tiny, tmp_path):
    """Each option changes the errors it should (against the shared measurement, made with
    the defaults on the same rows), is recorded in the measurement and the job's settings,
    and a resume with the other value is refused."""
    _, meas = converted
    shared = json.loads(meas.read_text())
    assert shared["scoring"] == {"error_reference": "layer", "heldout": 0.0, "hessian_rows": 4,
                                 "scored_rows": 4, "damp": 0.1, "shrink": 0.0,
                                 "sensitivity_rows": 4, "sensitivity_tokens": 128}  # fmt: skip
    base = shared["layers"][0]

    job = _first_layer_measurement(tiny, tmp_path / "module", error_reference="module")
    assert job["settings"]["error_reference"] == "module" and "heldout" not in job["settings"]
    got = job["state"]["measurement"]
    assert got["scoring"]["error_reference"] == "module"
    # The MLP is judged against the layer's output either way; the attention is not.
    assert got["layers"][0]["mlp"] == base["mlp"]
    assert all(
        a["err"] != b["err"] for a, b in zip(got["layers"][0]["attn"], base["attn"], strict=True)
    )
    with pytest.raises(ConvertError, match=r"\(error_reference\).*-nr"):
        _first_layer_measurement(tiny, tmp_path / "module")

    job = _first_layer_measurement(tiny, tmp_path / "held", heldout=0.5)
    assert job["settings"]["heldout"] == 0.5 and "error_reference" not in job["settings"]
    got = job["state"]["measurement"]
    assert got["scoring"] == {"error_reference": "layer", "heldout": 0.5, "hessian_rows": 2,
                              "scored_rows": 2, "damp": 0.1, "shrink": 0.0,
                              "sensitivity_rows": 4, "sensitivity_tokens": 128}  # fmt: skip
    for kind in ("attn", "mlp"):
        assert all(
            a["err"] != b["err"] for a, b in zip(got["layers"][0][kind], base[kind], strict=True)
        )
    with pytest.raises(ConvertError, match=r"\(heldout\).*-nr"):
        _first_layer_measurement(tiny, tmp_path / "held", heldout=0.25)


def test_a_measurement_without_scoring_settings_still_serves(converted, tiny, tmp_path):
    """Files written before the measurement recorded how it scored (the shipped SmolLM2
    one, loader/data, among them) still load and convert."""
    _, meas = converted
    old = json.loads(meas.read_text())
    del old["scoring"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    opts = _options(4.0, measurement_in=path, stop_after_layers=1)
    assert convert(tiny, tmp_path / "out", opts).quantized_now == [0]


def test_head_profiles_cover_exllamav2_head_bits():
    assert sorted(HEAD_PROFILES) == [2, 3, 4, 5, 6, 8]


def _kill_when(proc, job_file: Path, ready, timeout: float = 120.0) -> bool:
    """SIGKILL `proc` as soon as its job.json satisfies `ready`; False if it ended first."""
    import signal
    import time

    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            state = json.loads(job_file.read_text())["state"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            state = None
        if state is not None and ready(state):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.002)
    return False


@pytest.mark.slow
def test_sigkilled_conversion_resumes_to_the_same_output(tmp_path: Path):
    """convert.py killed with SIGKILL (no cleanup runs) once while measuring and once while
    quantizing, then run again: it resumes from what it had saved and writes the output an
    uninterrupted run writes, byte for byte."""
    import subprocess
    import sys

    src = tmp_path / "fp"
    make_tiny_llama(src, num_hidden_layers=8, **SHAPE)
    root = Path(__file__).resolve().parents[2]
    flags = ["-b", "4.0", "-r", "8", "-l", "128", "-mr", "4", "-ml", "128", "--device", "cpu",
             "--threads", "1"]  # fmt: skip

    def start(out: Path) -> subprocess.Popen:
        cmd = [sys.executable, str(root / "convert.py"), "-i", str(src), "-o", str(out), *flags]
        return subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    reference = tmp_path / "reference"
    assert start(reference).wait() == 0
    out = tmp_path / "killed"
    job_file = tmp_path / "killed.partial" / "job.json"
    measuring = lambda s: 1 <= len(s.get("measurement", {}).get("layers", [])) < 8  # noqa: E731
    quantizing = lambda s: 1 <= s.get("quantized_layers", 0) < 8  # noqa: E731
    for ready in (measuring, quantizing):
        assert _kill_when(start(out), job_file, ready), "the conversion ended before the kill"
        assert not out.exists() and job_file.is_file()
    finish = start(out)
    _, err = finish.communicate()
    assert finish.returncode == 0, err.decode()[-2000:]
    assert not job_file.parent.exists()
    for name in sorted(p.name for p in reference.iterdir()):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


def test_states_of_the_recorded_count_survive_a_kill_before_the_record(tmp_path: Path):
    """A kill after a layer's hidden states are saved but before its count is recorded must
    resume from the recorded count's states, not the newer ones (which already passed the
    layer the resumed run does again): CI once saw a SIGKILLed conversion resume to other
    bytes when one states file served every count."""
    from engine.quantizer.job import Job

    path = tmp_path / "out.partial"
    job = Job.open(path, {"bits": 4.0}, resume=True)
    after_one, after_two = torch.ones(2, 3), torch.full((2, 3), 2.0)
    job.advance_states("quant", 1, after_one, quantized_layers=1)
    job.save_tensors(Job.states_file("quant", 2), {"states": after_two})  # then the kill
    again = Job.open(path, {"bits": 4.0}, resume=True)
    assert again.get("quantized_layers") == 1
    assert torch.equal(again.load_states("quant", 1), after_one)
    again.advance_states("quant", 2, after_two, quantized_layers=2)
    assert torch.equal(again.load_states("quant", 2), after_two)
    assert not (path / Job.states_file("quant", 1)).exists()  # only the recorded count's


def test_a_listener_hears_every_stage_of_a_conversion(tiny, tmp_path):
    """The web UI shows the default model's preparation from these lines (issue 24, 9)."""
    heard: list[str] = []
    convert(tiny, tmp_path / "out", _options(4.0, listener=heard.append))
    stages = {line.split(" ", 1)[0] for line in heard}
    assert {"measure", "quantize", "compile"} <= stages
    # "<stage> <done>/<total> <unit>"; a stage may hold spaces ("quantize (shrinkage 0.3)").
    last_quantize = [line for line in heard if line.startswith("quantize")][-1]
    done, total = last_quantize.rsplit(" ", 2)[1].split("/")
    assert done == total  # the last report of a bar is its end
