"""The quantizer's shortcuts give what the long way gives, bit for bit: round to nearest
without the GPTQ row loop (and without calibration forwards), and the attention's output
replayed in a layer's later forwards instead of computed again."""

from __future__ import annotations

import pytest
import torch

from engine.quantizer.gptq import gptq_quantize, rtn_factors, rtn_quantize
from engine.quantizer.profiles import HEAD_PROFILES, LADDER

PROFILES = [LADDER[0], LADDER[3], LADDER[6], LADDER[9], HEAD_PROFILES[6]]


@pytest.mark.parametrize("search", ["fast", "full", "coarse"])
def test_rtn_quantize_is_gptq_with_rtn_factors(search: str) -> None:
    g = torch.Generator().manual_seed(2)
    n, k = 72, 320  # a short last group at k=320 for the 128-row profiles
    weight = torch.randn(n, k, generator=g) * 0.05
    weight[:, 7] = 0.0  # an input that is never used
    weight[3] = 0.0  # an all-zero output column of every group
    for profile in PROFILES:
        loop = gptq_quantize(weight, *rtn_factors(k), profile, scale_search=search)
        fast = rtn_quantize(weight, profile, scale_search=search)
        assert torch.equal(loop.codes, fast.codes), profile.name
        assert torch.equal(loop.scale_codes, fast.scale_codes), profile.name
        assert torch.equal(loop.scale_max, fast.scale_max), profile.name
        assert torch.equal(loop.invperm, fast.invperm), profile.name
        assert torch.equal(loop.dequantized, fast.dequantized), profile.name
        packed_loop, packed_fast = loop.pack(), fast.pack()
        assert packed_loop.keys() == packed_fast.keys()
        for name, tensor in packed_loop.items():
            assert torch.equal(tensor, packed_fast[name]), (profile.name, name)


@torch.inference_mode()
def test_replayed_attention_gives_the_layer_output(tmp_path) -> None:
    from engine.quantizer.capture import capture_layer
    from engine.quantizer.model import CalibrationRunner, LayerwiseModel
    from helpers.model_factory import make_tiny_llama

    make_tiny_llama(tmp_path, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2)  # fmt: skip
    lm = LayerwiseModel(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    runner = CalibrationRunner(lm, length=16, chunk_rows=2)
    layer = lm.load_layer(0)
    states = torch.randn(5, 16, 64, generator=torch.Generator().manual_seed(4))
    full, cap = capture_layer(runner, 0, states, outputs=["self_attn"])
    assert full is not None

    calls = []
    handle = layer.self_attn.q_proj.register_forward_hook(lambda *args: calls.append(1))
    try:
        replayed, rcap = capture_layer(
            runner, 0, states, hessians=["mlp.down_proj"], replay=cap.outputs
        )
    finally:
        handle.remove()
    assert calls == [], "the replayed attention ran"
    assert replayed is not None and torch.equal(replayed, full)
    assert "forward" not in vars(layer.self_attn), "the attention's own forward is not back"
    # The Hessian behind the replayed attention is the one a full forward collects.
    _, direct = capture_layer(runner, 0, states, hessians=["mlp.down_proj"])
    assert torch.equal(rcap.hessians["mlp.down_proj"], direct.hessians["mlp.down_proj"])
