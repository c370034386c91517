"""Every architecture against transformers' own implementation on tiny random checkpoints.

Each case saves a random model with save_pretrained, loads it with Kestrel in float32 and
checks (a) the logits of a 150-token prompt fed in 48-token chunks over 16-token pages and
(b) 32 greedy tokens after a 20-token prompt, against the transformers model (eager
attention). Sliding windows are small (24) so that both the prompt and the decode cross
them; soft-caps are small so that they bend the scores.

A second set rewrites config.json into the spelling older transformers wrote (still most
of the Hub) and checks that the same weights give the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import loader
from engine.architectures import (
    ARCHITECTURES,
    UnsupportedArchitectureError,
    architecture_class,
)
from engine.weights import WeightError
from helpers.architectures import CASES
from helpers.model_factory import make_tiny_model


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _prompt(n: int, vocab: int = 384, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _load(path: Path, device: str, **options: Any):
    return loader.load(
        path, "kestrel", device=device, dtype="float32", page_size=16, prefill_chunk=48, **options
    )


def _has_fused_experts(path: Path) -> bool:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return any(name.endswith(".experts.gate_up_proj") for name in f.keys())


def _hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=1,
    )
    return out[0, len(ids) :].tolist()


def test_every_architecture_is_registered_and_unknown_ones_refused():
    expected = {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Phi3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
    }
    assert expected <= set(ARCHITECTURES)
    with pytest.raises(UnsupportedArchitectureError, match="not supported.*Gemma3ForCausalLM"):
        architecture_class("FancyNewForCausalLM")


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(tmp_path: Path, case: str, device: str):
    config_cls, overrides, options = CASES[case]
    hf = make_tiny_model(tmp_path, config_cls, **overrides)
    if "fused" in case and not _has_fused_experts(tmp_path):
        pytest.skip("this transformers wrote per-expert tensors: the fused layout is untested")

    ids = _prompt(150)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = _load(tmp_path, device).logits(ids)
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert _rel_err(ours, ref) < 1e-4, f"{case}: logits differ"

    prompt = _prompt(20, seed=7)
    ref_tokens = _hf_greedy(hf, prompt, 32)
    max_seq_len = options.get("greedy_max_seq_len")
    m = _load(tmp_path, device, **({"max_seq_len": max_seq_len} if max_seq_len else {}))
    settings = {"max_new_tokens": 32, "temperature": 0, "ban_eos_token": True}
    tokens = [t for chunk in m.stream(prompt, settings) for t in chunk.token_ids]
    assert tokens == ref_tokens, f"{case}: greedy tokens differ"


def _qwen2_hub_config(c: dict[str, Any]) -> None:
    # transformers 4 kept a window that applies to nothing while use_sliding_window is off.
    c.pop("layer_types")
    c.update(sliding_window=32768, use_sliding_window=False, max_window_layers=0)


def _gemma2_hub_config(c: dict[str, Any]) -> None:
    c.pop("layer_types")  # alternating, layer 0 sliding
    c.update(hidden_act="gelu_pytorch_tanh", cache_implementation="hybrid")


def _gemma3_hub_config(c: dict[str, Any]) -> None:
    c.pop("layer_types")
    c.pop("rope_parameters")
    c.update(
        rope_theta=500000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_local_base_freq=20000.0,
        sliding_window_pattern=2,
    )


def _phi3_hub_config(c: dict[str, Any]) -> None:
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope["rope_theta"]
    c["rope_scaling"] = {
        "type": "su",
        "short_factor": rope["short_factor"],
        "long_factor": rope["long_factor"],
    }


def _qwen3_moe_hub_config(c: dict[str, Any]) -> None:
    c["num_experts"] = c.pop("num_local_experts")


HUB_CONFIGS = {
    "qwen2-tied": _qwen2_hub_config,
    "qwen3-moe": _qwen3_moe_hub_config,
    "phi3-longrope": _phi3_hub_config,
    "gemma2": _gemma2_hub_config,
    "gemma3": _gemma3_hub_config,
}


@pytest.mark.parametrize("case", list(HUB_CONFIGS))
def test_older_config_spellings(tmp_path: Path, case: str):
    config_cls, overrides, _ = CASES[case]
    hf = make_tiny_model(tmp_path, config_cls, **overrides)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    HUB_CONFIGS[case](config)
    path.write_text(json.dumps(config))

    ids = _prompt(150, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert _rel_err(_load(tmp_path, "cpu").logits(ids), ref) < 1e-4


def test_gemma3_local_and_global_layers_rotate_differently(tmp_path: Path):
    """Guards the per-layer RoPE tables: one shared table would not match transformers."""
    config_cls, overrides, _ = CASES["gemma3"]
    make_tiny_model(tmp_path, config_cls, **overrides)
    model = _load(tmp_path, "cpu").backend.model
    local, full = model._layer_rotary
    assert local.cos.shape == full.cos.shape and not torch.equal(local.cos, full.cos)


def test_longrope_without_factors_is_refused(tmp_path: Path):
    config_cls, overrides, _ = CASES["phi3-longrope"]
    make_tiny_model(tmp_path, config_cls, **overrides)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    del config["rope_parameters"]["long_factor"]
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="longrope.*long_factor"):
        _load(tmp_path, "cpu")


def _repeat_head_norms(model_dir: Path, config: dict[str, Any], *, vary: bool = False) -> None:
    """Rewrite q_norm/k_norm as exllamav2's converter saves them: one row per head (q over
    the attention heads, k over the KV heads); `vary` makes the last head's row differ."""
    file = model_dir / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    for key, t in list(tensors.items()):
        if key.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            heads = config["num_attention_heads" if ".q_norm" in key else "num_key_value_heads"]
            rows = t.repeat(heads, 1).contiguous()
            if vary:
                rows[-1, 0] += 0.5
            tensors[key] = rows
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
def test_head_norms_stored_per_head_as_exllamav2_writes_them(tmp_path: Path, case: str):
    """exllamav2 repeats Qwen3's and Gemma 3's q/k norm weight per head when it loads a model
    and its converter saves them so: its EXL2 files hold [heads, head_dim]. The same logits."""
    config_cls, overrides, _ = CASES[case]
    make_tiny_model(tmp_path, config_cls, **overrides)
    ids = _prompt(60, seed=5)
    ref = _load(tmp_path, "cpu").logits(ids)
    config = json.loads((tmp_path / "config.json").read_text())
    _repeat_head_norms(tmp_path, config)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        shape = f.get_slice("model.layers.0.self_attn.q_norm.weight").get_shape()
    assert shape == [config["num_attention_heads"], config["head_dim"]]
    assert torch.equal(_load(tmp_path, "cpu").logits(ids), ref)


def test_head_norms_that_differ_per_head_are_refused(tmp_path: Path):
    config_cls, overrides, _ = CASES["qwen3"]
    make_tiny_model(tmp_path, config_cls, **overrides)
    config = json.loads((tmp_path / "config.json").read_text())
    _repeat_head_norms(tmp_path, config, vary=True)
    with pytest.raises(WeightError, match=r"layers\.0\.self_attn\.q_norm\.weight.*different"):
        _load(tmp_path, "cpu")
