"""RMSNorm folded into the decode GEMVs in the engine (issue 28, engine/norm_fold.py). The fold
rounds h * w where rms_norm rounded h * rstd * w, so its bits are not the unfused ops': greedy
decode of a tiny quantized model gives the same tokens with the fold on and off up to any
near tie, and logits within a tolerance; with the fold on, every run gives the same tokens
and logits bit for bit, with PDL on or off; one decode step launches 3 * layers - 1 kernels
fewer (each layer's two add_rms_norm launches but the first layer's input norm, which stays
a kernel, and every layer's RoPE + cache write launch: its qkv slot sum does it, the first
layer's without the norm). The kernels' own tests, on the CPU too, are
tests/kernels/test_norm_fold.py and test_qkv_rope.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import modules, norm_fold
from engine.cache import ForwardBatch, Sequence
from engine.engine import Engine, EngineOptions
from engine.modules import DecoderLayer
from engine.norm_fold import set_norm_fold
from helpers.decoding import greedy_with_logits
from kernels.backend import set_programmatic_launch
from tools.bench import SHAPES, build_model

STEPS = 24
# Logits of the tiny float16 model, fold against unfused, relative to each row's largest:
# the two paths differ by about an ulp of float16 (2^-11) per rounding, a few layers deep;
# a missing or doubled rstd or a scaled bias moves the logits by tens of percent.
LOGIT_RTOL = 2e-2


def _engine(model: Path, graphs: bool) -> Engine:
    options = EngineOptions(
        device="cuda", dtype="float16", max_seq_len=256, cache_tokens=1024, cuda_graphs=graphs
    )
    return Engine.load(model, options)


def _decode(model: Path, graphs: bool, fold: bool, pdl: bool = True):
    prompt = torch.randint(2, 1000, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    set_norm_fold(fold)
    set_programmatic_launch(pdl)
    try:
        engine = _engine(model, graphs)
        try:
            return greedy_with_logits(engine, prompt, STEPS)
        finally:
            engine.unload()
    finally:
        set_norm_fold(True)
        set_programmatic_launch(True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_decode_with_the_fold_matches_the_unfused_ops(
    fmt: str, graphs: bool, tmp_path: Path
) -> None:
    """Tokens equal until a near tie (the unfused run's top two logits closer than the
    tolerance), logits within the tolerance up to and including that step (the same token
    history until then)."""
    model = build_model(tmp_path / fmt, "tiny", fmt)
    off_tokens, off_logits = _decode(model, graphs, fold=False)
    on_tokens, on_logits = _decode(model, graphs, fold=True)
    same = next((i for i in range(STEPS) if on_tokens[i] != off_tokens[i]), STEPS)
    rows = same + 1  # logits row i is the one token i was taken from
    scale = off_logits[:rows].abs().amax(dim=-1, keepdim=True)
    diff = (on_logits[:rows] - off_logits[:rows]).abs()
    assert (diff <= LOGIT_RTOL * scale).all(), (diff / scale).max()
    if same < STEPS:
        top2 = off_logits[same].topk(2).values
        assert top2[0] - top2[1] <= 2 * LOGIT_RTOL * scale[same, 0], (same, top2)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_the_fold_gives_the_same_bits_every_run(graphs: bool, tmp_path: Path) -> None:
    """Greedy tokens and logits bit for bit across runs, with PDL on and off."""
    model = build_model(tmp_path / "gptq", "tiny", "gptq")
    first = _decode(model, graphs, fold=True)
    for pdl in (True, False):
        again = _decode(model, graphs, fold=True, pdl=pdl)
        assert again[0] == first[0] and torch.equal(again[1], first[1]), pdl


def _kernels_per_step(engine: Engine) -> int:
    seq = Sequence()
    token = int(engine.runner.prefill(seq, list(range(2, 30)))[-1].argmax())

    def step() -> None:
        seq.reserve(engine.cache, seq.length + 1)
        engine.model(ForwardBatch.build(engine.cache, [seq], [[token]]), engine.cache)

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(
        e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
    )


@pytest.mark.gpu
def test_the_fold_removes_the_norm_and_rope_launches(tmp_path: Path) -> None:
    model = build_model(tmp_path / "gptq", "tiny", "gptq")
    counts = {}
    try:
        for enabled in (False, True):
            set_norm_fold(enabled)
            engine = _engine(model, graphs=False)
            try:
                layers = len(engine.model.model.layers)
                counts[enabled] = _kernels_per_step(engine)
            finally:
                engine.unload()
    finally:
        set_norm_fold(True)
    # Two norms per layer but the first layer's input norm, and RoPE + the cache write in
    # every layer's qkv slot sum (the first layer's without the norm: its qkv reads a norm
    # kernel's output, kernels/quant_matmul/qkv_rope.py).
    assert counts[False] - counts[True] == 2 * layers - 1 + layers, counts


def _count_folds(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """From now on, whether each decoder layer call takes the fold, appended in order."""
    folds: list[bool] = []
    real_folded = DecoderLayer._folded

    def counted(self, x, batch):
        chosen = real_folded(self, x, batch)
        folds.append(chosen is not None)
        return chosen

    monkeypatch.setattr(DecoderLayer, "_folded", counted)
    return folds


@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
def test_the_engine_fold_matches_the_unfused_ops_on_the_interpreter(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's fold path (FoldedHidden between layers, xw and squares from o_proj and
    down_proj, rstd in qkv's and gate_up's slot sums) where no GPU is: the same kernels
    through the Triton interpreter on CPU tensors, against the engine's unfused CPU path
    (torch's ops). Greedy tokens and logits as in the GPU test above, fewer steps."""
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("the interpreter's run of the fold; on a GPU the tests above run it")
    model = build_model(tmp_path / fmt, "tiny", fmt, device="cpu")
    prompt = torch.randint(2, 1000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    steps = 6
    folds = _count_folds(monkeypatch)
    rotated = []
    real_rope = modules.quant_matmul_normed_rope

    def counted_rope(*args, **kwargs):  # qkv's slot sum with RoPE and the cache write in it
        rotated.append(True)
        return real_rope(*args, **kwargs)

    monkeypatch.setattr(modules, "quant_matmul_normed_rope", counted_rope)
    first_rotated = []
    real_first = modules.quant_matmul_rope

    def counted_first(*args, **kwargs):  # the same, for qkv after a norm kernel (no fold)
        first_rotated.append(True)
        return real_first(*args, **kwargs)

    monkeypatch.setattr(modules, "quant_matmul_rope", counted_first)
    results = {}
    for fold in (False, True):
        monkeypatch.setattr(norm_fold, "kernels_run_on", lambda x, fold=fold: fold)
        folds.clear()
        rotated.clear()
        first_rotated.clear()
        options = EngineOptions(device="cpu", dtype="float16", max_seq_len=64, cache_tokens=128)
        engine = Engine.load(model, options)
        try:
            results[fold] = greedy_with_logits(engine, prompt, steps)
        finally:
            engine.unload()
        # Every decode step folds every layer; the prompt's pass (one per layer, its rows
        # over GEMV_MAX_M) never does.
        assert folds.count(True) == (len(folds) - 4 if fold else 0) and len(folds) > 8, folds
        # Every folded layer but a step's first (its input norm runs as a kernel after the
        # embedding) rotates q and writes k and v in qkv's slot sum.
        assert len(rotated) == (steps * 3 if fold else 0), len(rotated)
        # A step's first layer does too, without the norm (kernels/quant_matmul/qkv_rope.py).
        assert len(first_rotated) == (steps if fold else 0), len(first_rotated)
    off_tokens, off_logits = results[False]
    on_tokens, on_logits = results[True]
    scale = off_logits.abs().amax(dim=-1, keepdim=True)
    assert on_tokens == off_tokens
    assert ((on_logits - off_logits).abs() <= LOGIT_RTOL * scale).all()


def test_a_loaded_adapter_leaves_plain_requests_folded_on_the_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading a LoRA adapter wraps the linears (engine/lora/layers.py); requests that use no
    adapter must still fold, bit for bit as before the load (the base model's output must not
    depend on what else is loaded), and a request under the adapter takes the unfused path
    with its deltas. Through the interpreter on CPU tensors, as the test above."""
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("the interpreter's run of the fold; on a GPU the tests above run it")
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers.lora import ALL, make_adapter

    model = build_model(tmp_path / "gptq", "tiny", "gptq", device="cpu")
    config = AutoConfig.from_pretrained(model)
    config.quantization_config = None
    del config.quantization_config
    adapter = tmp_path / "adapter"
    make_adapter(AutoModelForCausalLM.from_config(config), adapter, seed=5, r=8, target_modules=ALL)
    prompt = torch.randint(2, 1000, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    steps = 4
    folds = _count_folds(monkeypatch)
    monkeypatch.setattr(norm_fold, "kernels_run_on", lambda x: True)
    options = EngineOptions(device="cpu", dtype="float16", max_seq_len=64, cache_tokens=128)
    engine = Engine.load(model, options)
    try:
        runs = {}
        for label in ("before", "loaded", "selected"):
            if label == "loaded":
                name = engine.loras.load(adapter)
            if label == "selected":
                engine.loras.set_default({name: 1.0})
            folds.clear()
            runs[label] = (greedy_with_logits(engine, prompt, steps), list(folds))
    finally:
        engine.unload()
    (tokens, logits), folded = runs["before"]
    layers = len(folded) // (steps + 1)
    assert folded.count(True) == steps * layers and folded.count(False) == layers, folded
    (loaded_tokens, loaded_logits), loaded_folds = runs["loaded"]
    assert loaded_folds == folded
    assert loaded_tokens == tokens and torch.equal(loaded_logits, logits)
    (_, adapted_logits), adapted_folds = runs["selected"]
    assert not any(adapted_folds), adapted_folds
    assert not torch.allclose(adapted_logits, logits, rtol=LOGIT_RTOL), "the adapter did nothing"


_REAL_NORMED = modules.quant_matmul_normed
ROW_ORDER_STEPS = 6
_REAL_NORMED_ROPE = modules.quant_matmul_normed_rope


def _decode_row_order(model: Path, device: str, enabled: bool, monkeypatch: pytest.MonkeyPatch):
    """Greedy tokens and logits with the fold, its inputs in row order or not, and for each
    folded qkv (all but a step's first layer's) and gate_up GEMV whether it read x in its
    row order."""
    in_row_order: list[bool] = []

    def counted_normed(*args, **kwargs):
        in_row_order.append(bool(kwargs.get("x_in_row_order")))
        return _REAL_NORMED(*args, **kwargs)

    def counted_rope(*args, **kwargs):
        in_row_order.append(bool(kwargs.get("x_in_row_order")))
        return _REAL_NORMED_ROPE(*args, **kwargs)

    monkeypatch.setattr(modules, "quant_matmul_normed", counted_normed)
    monkeypatch.setattr(modules, "quant_matmul_normed_rope", counted_rope)
    norm_fold.set_input_row_order(enabled)
    prompt = torch.randint(2, 1000, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    try:
        options = EngineOptions(device=device, dtype="float16", max_seq_len=64, cache_tokens=128)
        engine = Engine.load(model, options)
        try:
            tokens, logits = greedy_with_logits(engine, prompt, ROW_ORDER_STEPS)
        finally:
            engine.unload()
    finally:
        norm_fold.set_input_row_order(True)
    return tokens, logits, in_row_order


def _row_order_case(
    model: Path, device: str, monkeypatch: pytest.MonkeyPatch, *, every_step: bool
) -> None:
    off_tokens, off_logits, off_calls = _decode_row_order(model, device, False, monkeypatch)
    on_tokens, on_logits, on_calls = _decode_row_order(model, device, True, monkeypatch)
    # Every folded qkv and gate_up reads xw in its row order when on (EXL2 weights all
    # have a perm), none when off; the bits are the same either way. Per eager decode
    # step (`every_step`: no graphs, whose replays call no Python): a gate_up per layer,
    # a qkv per layer but the first.
    layers = SHAPES["tiny"]["num_hidden_layers"]
    assert len(on_calls) == len(off_calls) > 0, (on_calls, off_calls)
    if every_step:
        assert len(on_calls) == ROW_ORDER_STEPS * (2 * layers - 1), on_calls
    assert all(on_calls) and not any(off_calls), (on_calls, off_calls)
    assert on_tokens == off_tokens and torch.equal(on_logits, off_logits)


def test_inputs_in_row_order_give_the_same_bits_on_the_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qkv's, gate_up's and down_proj's inputs stored in their weights' row order by the
    slot sums before them (engine/norm_fold.py: input_row_order): greedy tokens and logits
    of an EXL2 model equal those with the gathers, bit for bit."""
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("the interpreter's run of the fold; on a GPU the test below runs it")
    model = build_model(tmp_path / "exl2", "tiny", "exl2", device="cpu")
    monkeypatch.setattr(norm_fold, "kernels_run_on", lambda x: True)
    _row_order_case(model, "cpu", monkeypatch, every_step=True)


@pytest.mark.gpu
def test_inputs_in_row_order_give_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, compiled, with the decode graphs (captured after the eager warm-up that
    computes each weight's row order)."""
    model = build_model(tmp_path / "exl2", "tiny", "exl2")
    _row_order_case(model, "cuda", monkeypatch, every_step=False)


def test_an_xw_in_one_weights_row_order_is_read_by_that_weight_alone() -> None:
    """FoldedHidden.xw_for: an xw stored in a weight's row order goes to that weight's GEMV
    (in order) and to no other; an xw in h's order goes to any (gathered)."""
    from helpers.quant_weights import make_weight
    from kernels.quant_matmul.slot_sum import RowSquares

    qkv, other = make_weight(64, 32, [4], seed=1), make_weight(64, 32, [4], seed=2)
    h, xw = torch.zeros(1, 64), torch.ones(1, 64)
    squares = RowSquares(torch.zeros(1, 2), 32)
    ordered = norm_fold.FoldedHidden(h, squares, xw, None, qkv.perm)
    got = ordered.xw_for(qkv)
    assert got is not None and got[0] is xw and got[1] is True
    assert ordered.xw_for(other) is None
    plain = norm_fold.FoldedHidden(h, squares, xw, None)
    assert plain.xw_for(other) == (xw, False)
    assert norm_fold.FoldedHidden(h, squares).xw_for(qkv) is None
