"""Batched GPTQ (all candidates of a linear in one sweep) and the measurement's shortcuts
give what one-at-a-time runs give: the same objective, on CPU and on a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.quantizer import scales
from engine.quantizer.gptq import (
    gptq_quantize,
    gptq_quantize_many,
    output_error,
    prepare_hessian,
)
from engine.quantizer.profiles import HEAD_PROFILES, LADDER

# Mixed group sizes (32, 64, 128, and a short last group at k=320) so blocks cut groups.
PROFILES = [*LADDER, HEAD_PROFILES[4]]


def _linear(k: int = 320, n: int = 72, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = (torch.randn(1024, k, generator=g) * torch.rand(k, generator=g) * 3) @ mix
    weight = torch.randn(n, k, generator=g) * 0.05
    return weight, x.t() @ x


def _check_many_against_single(device: str, search: str) -> None:
    weight, hessian = _linear()
    weight, hessian = weight.to(device), hessian.to(device)
    perm, upper = prepare_hessian(hessian)
    many = gptq_quantize_many(weight, perm, upper, PROFILES, scale_search=search)
    assert len(many) == len(PROFILES)
    for profile, batched in zip(PROFILES, many, strict=True):
        single = gptq_quantize(weight, perm, upper, profile, scale_search=search)
        assert (batched.group_bits, batched.group_sizes) == profile.layout(weight.shape[1])
        e_many = output_error(weight, batched.dequantized, hessian)
        e_single = output_error(weight, single.dequantized, hessian)
        # The same sums in another order: a code may round the other way at a tie, and
        # its error feeds forward, so equal up to float noise, not bit for bit.
        assert abs(e_many - e_single) <= 2e-3 * e_single, (profile.name, e_many, e_single)
        same = (batched.codes == single.codes).float().mean().item()
        assert same > 0.98, (profile.name, same)
        packed = batched.pack()  # dequantize_exl2 of the packed tensors == dequantized
        bits = sum(t.numel() * t.element_size() * 8 for t in packed.values())
        assert bits == profile.storage_bits(weight.shape[1], weight.shape[0])


@pytest.mark.parametrize("search", ["coarse", "fast"])
def test_many_profiles_in_one_sweep_match_one_at_a_time(search):
    _check_many_against_single("cpu", search)


def test_sweeps_split_by_batch_elements_keep_order():
    weight, hessian = _linear(k=256, n=40, seed=1)
    perm, upper = prepare_hessian(hessian)
    profiles = list(LADDER[:5])
    whole = gptq_quantize_many(weight, perm, upper, profiles, scale_search="coarse")
    split = gptq_quantize_many(
        weight, perm, upper, profiles, scale_search="coarse", batch_elements=2 * 256 * 40
    )
    for profile, a, b in zip(profiles, whole, split, strict=True):
        assert b.group_bits == profile.layout(256)[0]
        ea, eb = (output_error(weight, r.dequantized, hessian) for r in (a, b))
        assert abs(ea - eb) <= 2e-3 * ea, profile.name


def _textbook_gptq(weight, perm, upper, profile):
    """GPTQ as the paper writes it: row by row, each row's error pushed to every later row
    at once (no blocks), each group's scales fitted when it is reached."""
    w = weight.t()[perm].clone()
    quant = torch.empty_like(w)
    a = 0
    for bits, size in zip(*profile.layout(w.shape[0]), strict=True):
        _, _, scale = scales.fit_scales(w[a : a + size], bits, "fast")
        s = scale.float()
        s = torch.where(s == 0, torch.ones_like(s), s)
        for i in range(a, a + size):
            q = torch.clamp(torch.round(w[i] / s), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * s
            quant[i] = q
            w[i + 1 :] -= torch.outer(upper[i, i + 1 :], (w[i] - q) / upper[i, i])
        a += size
    return quant[torch.argsort(perm)].t()


def test_blocked_sweeps_compute_textbook_gptq():
    """One profile (blocks = its groups) and ten at once (blocks cut at every candidate's
    group boundary) both give the row-by-row algorithm's result, up to float order."""
    weight, hessian = _linear(k=256, n=48, seed=2)
    perm, upper = prepare_hessian(hessian)
    profiles = [LADDER[0], LADDER[4], HEAD_PROFILES[2]]
    many = gptq_quantize_many(weight, perm, upper, profiles, scale_search="fast")
    for profile, batched in zip(profiles, many, strict=True):
        reference = _textbook_gptq(weight, perm, upper, profile)
        e_ref = output_error(weight, reference, hessian)
        single = gptq_quantize(weight, perm, upper, profile, scale_search="fast")
        for result in (single, batched):
            e = output_error(weight, result.dequantized, hessian)
            assert abs(e - e_ref) <= 2e-3 * e_ref, (profile.name, e, e_ref)
            same = torch.isclose(result.dequantized, reference, rtol=0, atol=1e-6).float().mean()
            assert same > 0.98, (profile.name, float(same))


def test_numpy_scale_search_picks_what_the_torch_search_picks():
    """The CPU search (numpy, float32 GEMV sums) and the torch one (GPU, float64 sums)
    choose the same factor."""
    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        rows, n = (32, 64, 128)[trial % 3], (40, 200, 576)[trial % 3]
        x = torch.randn(rows, n, generator=g) * torch.rand(n, generator=g)
        x *= 10.0 ** (trial % 5 - 3)
        bits = (2, 3, 4, 5, 6, 8)[trial % 6]
        for refine, points in ((False, list(range(0, 97, 16))), (True, list(range(0, 97, 8)))):
            qs_np, smax_np, best_np = scales._search_numpy(x, bits, points, refine=refine)
            qs_t, smax_t, best_t = scales._search_torch(x, bits, points, refine=refine)
            assert torch.equal(qs_np, qs_t) and torch.equal(smax_np, smax_t)
            assert best_np == best_t, (trial, refine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("search", ["full", "coarse"])
def test_many_profiles_in_one_sweep_on_gpu(search):
    _check_many_against_single("cuda", search)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sweep_matches_cpu_sweep():
    weight, hessian = _linear(seed=4)
    perm, upper = prepare_hessian(hessian)
    cpu = gptq_quantize_many(weight, perm, upper, LADDER, scale_search="full")
    perm_g, upper_g = prepare_hessian(hessian.cuda())
    gpu = gptq_quantize_many(weight.cuda(), perm_g, upper_g, LADDER, scale_search="full")
    for profile, a, b in zip(LADDER, cpu, gpu, strict=True):
        ea = output_error(weight, a.dequantized, hessian)
        eb = output_error(weight, b.dequantized.cpu(), hessian)
        assert abs(ea - eb) <= 1e-2 * ea, (profile.name, ea, eb)


@torch.inference_mode()
def test_measurement_scores_equal_full_module_forwards(tmp_path):
    """The measurement's shortcuts (the forward stops at the output linear; one matmul
    scores a class's candidates) give the scores a full module forward per candidate
    gives, over several row chunks."""
    from torch import nn

    from engine.quantizer.capture import capture_layer
    from engine.quantizer.measure import _candidate_errors
    from engine.quantizer.model import CalibrationRunner, LayerwiseModel, module_specs
    from helpers.model_factory import make_tiny_llama

    make_tiny_llama(tmp_path, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2)  # fmt: skip
    lm = LayerwiseModel(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    runner = CalibrationRunner(lm, length=16, chunk_rows=2)
    layer = lm.load_layer(0)
    states = torch.randn(5, 16, 64, generator=torch.Generator().manual_seed(5))
    for spec in module_specs(layer):
        out, cap = capture_layer(runner, 0, states, inputs=[spec.path], outputs=[spec.path])
        stream_norm = out.norm(dim=-1)
        out_linear = layer.get_submodule(spec.output_linear)
        x_in, y_ref = cap.inputs[spec.path], cap.outputs[spec.path]
        # The module's own output weight reproduces its output: the forward stopped at the
        # output linear's input.
        own = _candidate_errors(
            runner, 0, spec, out_linear, x_in, [out_linear.weight], y_ref, stream_norm
        )
        assert own[0] <= 1e-6, spec.kind

        original = out_linear.weight
        noisy = [original + 0.01 * i * torch.randn_like(original) for i in (1, 2, 3)]
        batched = _candidate_errors(runner, 0, spec, out_linear, x_in, noisy, y_ref, stream_norm)
        try:
            for w, err in zip(noisy, batched, strict=True):
                out_linear.weight = nn.Parameter(w)
                y = runner.run_module(0, spec.path, x_in)
                direct = ((y - y_ref).norm(dim=-1) / stream_norm).square().mean().sqrt()
                assert err == pytest.approx(float(direct), rel=1e-4), spec.kind
        finally:
            out_linear.weight = original


def test_calibration_outputs_do_not_depend_on_the_row_chunking(tmp_path) -> None:
    """A one-row chunk is a single sequence with nothing cached, which a model forward would
    send to the fresh-prompt attention: calibration keeps every chunk on the paged kernel, so
    a layer's outputs are the same bits whatever the chunking (a resumed conversion must
    write the bytes an uninterrupted one writes)."""
    from engine.quantizer.model import CalibrationRunner, LayerwiseModel
    from helpers.model_factory import make_tiny_llama

    make_tiny_llama(tmp_path, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2)  # fmt: skip
    lm = LayerwiseModel(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    lm.load_layer(0)
    states = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(3))
    one = CalibrationRunner(lm, length=16, chunk_rows=1).run_layer(0, states)
    all_rows = CalibrationRunner(lm, length=16, chunk_rows=3).run_layer(0, states)
    assert torch.equal(one, all_rows)
