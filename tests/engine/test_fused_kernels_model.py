"""Fused small-op kernels in whole models (EngineOptions.fuse_kernels): residual adds inside
the next RMSNorm, SiLU * up as one kernel, RoPE + KV cache write as one kernel. A fused
engine must give the logits and greedy tokens of an unfused one:

- on CPU with the torch references, bit for bit, for every architecture family that fuses
  (Llama, Qwen3, Phi-3, Gemma 2's sandwich norms, Mixtral/Qwen3-MoE experts), through
  prefill, single-row decode, batched decode steps and a quantized cache (no rope fusion);
- on CPU with the Triton kernels forced (interpreter), to float32 rounding;
- on a GPU (`gpu`), float16 and bfloat16, eager prefill and CUDA-graph decode, bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

import kernels
from engine.cache import Sequence
from engine.engine import Engine, EngineOptions
from engine.fusion import set_kernel_fusion
from helpers.decoding import greedy_with_logits
from helpers.model_factory import make_tiny_llama, make_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 33, 8, 190]
STEPS = 6
FUSED_OPS = ("add_rms_norm", "silu_mul", "apply_rope_write")

MOE = dict(num_experts_per_tok=2)
# name: (config class or None for make_tiny_llama, overrides)
ARCHS: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama": (None, {}),
    "qwen3": (tf.Qwen3Config, dict(head_dim=32)),
    "phi3-partial-rotary": (tf.Phi3Config, dict(partial_rotary_factor=0.5)),
    "gemma2": (
        tf.Gemma2Config,
        dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8, final_logit_softcapping=10.0),
    ),
    "mixtral-fused-experts": (
        tf.MixtralConfig,
        dict(num_local_experts=4, save_original_format=False, **MOE),
    ),
    "qwen3-moe": (
        tf.Qwen3MoeConfig,
        dict(num_experts=4, moe_intermediate_size=48, mlp_only_layers=[1], **MOE),
    ),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random checkpoints, made on first use per architecture."""
    made: dict[str, Path] = {}

    class Dirs(dict):
        def __missing__(self, name: str) -> Path:
            config_cls, overrides = ARCHS[name]
            path = tmp_path_factory.mktemp(name)
            if config_cls is None:
                make_tiny_llama(path, seed=5, **overrides)
            else:
                make_tiny_model(path, config_cls, seed=5, **overrides)
            self[name] = path
            return path

    return Dirs(made)


def _engine(path: Path, *, fuse: bool, device: str = "cpu", dtype: str = "float32", **options):
    opts: dict[str, Any] = dict(
        device=device, dtype=dtype, max_seq_len=64, page_size=8, cache_tokens=256
    )
    opts.update(options)
    return Engine.load(path, EngineOptions(**opts, fuse_kernels=fuse))


@contextlib.contextmanager
def _counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """Count calls of the fused ops (the modules look them up on `kernels` per call)."""
    calls: Counter = Counter()
    with monkeypatch.context() as patch:
        for name in FUSED_OPS:
            op = getattr(kernels, name)

            def counted(*args: Any, _op: Any = op, _name: str = name, **kwargs: Any) -> Any:
                calls[_name] += 1
                return _op(*args, **kwargs)

            patch.setattr(kernels, name, counted)
        yield calls


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_equals_unfused_on_the_reference_path(
    arch: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fused, plain = _engine(model_dirs[arch], fuse=True), _engine(model_dirs[arch], fuse=False)
    layers = fused.config.num_hidden_layers
    with _counting(monkeypatch) as calls:
        fused_logits = fused.logits(PROMPT)  # every row wanted: norm, then gather
    # Two residual adds per layer, the last one in the final norm; SiLU MLPs and rope.
    assert calls["add_rms_norm"] == 2 * layers
    assert calls["apply_rope_write"] == layers
    silu = fused.config.hidden_act == "silu" and arch != "gemma2"
    assert (calls["silu_mul"] > 0) == silu
    with _counting(monkeypatch) as calls:
        plain_logits = plain.logits(PROMPT)
    assert not calls, "fuse_kernels=False still ran a fused kernel"
    assert torch.equal(fused_logits, plain_logits)

    fused_tokens, fused_rows = greedy_with_logits(fused, PROMPT, STEPS)  # prefill gathers first
    plain_tokens, plain_rows = greedy_with_logits(plain, PROMPT, STEPS)
    assert fused_tokens == plain_tokens
    assert torch.equal(fused_rows, plain_rows)


def test_set_kernel_fusion_switches_every_module(model_dirs: dict[str, Path]) -> None:
    engine = _engine(model_dirs["mixtral-fused-experts"], fuse=True)
    flags = [m.fuse_kernels for m in engine.model.modules() if hasattr(m, "fuse_kernels")]
    # CausalLM, per layer Attention and the MoE's fused experts.
    assert len(flags) == 1 + 2 * engine.config.num_hidden_layers and all(flags)
    assert set_kernel_fusion(engine.model, False) == len(flags)
    assert not any(m.fuse_kernels for m in engine.model.modules() if hasattr(m, "fuse_kernels"))


def test_batched_decode_steps_and_graph_buffers(model_dirs: dict[str, Path]) -> None:
    """Several sequences per step, through the decode graphs' static buffers (capture=False:
    padding rows included) and eagerly."""
    path = model_dirs["llama"]
    prompts = [PROMPT, [11, 12, 13, 14, 15], [300, 301, 7]]
    results = {}
    for fuse in (True, False):
        for graphs in (True, False):
            engine = _engine(path, fuse=fuse)
            if graphs:
                engine.enable_decode_graphs(capture=False)
            seqs = [Sequence() for _ in prompts]
            last = [engine.runner.prefill(s, p) for s, p in zip(seqs, prompts, strict=True)]
            steps = []
            for _ in range(4):
                tokens = [[int(row.argmax())] for row in last]
                last = list(engine.runner.forward(seqs, tokens))
                steps.append(torch.stack(last))
            results[fuse, graphs] = torch.stack(steps)
    for graphs in (True, False):
        assert torch.equal(results[True, graphs], results[False, graphs])


def test_quantized_cache_keeps_rope_and_write_apart(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = model_dirs["llama"]
    fused = _engine(path, fuse=True, cache_type="q8")
    plain = _engine(path, fuse=False, cache_type="q8")
    with _counting(monkeypatch) as calls:
        fused_logits = fused.logits(PROMPT)
    assert calls["apply_rope_write"] == 0 and calls["add_rms_norm"] > 0
    assert torch.equal(fused_logits, plain.logits(PROMPT))
    assert (
        greedy_with_logits(fused, PROMPT, STEPS)[0] == greedy_with_logits(plain, PROMPT, STEPS)[0]
    )


@pytest.mark.parametrize(
    ("arch", "dtype"), [("llama", "float32"), ("llama", "bfloat16"), ("gemma2", "float32")]
)
def test_triton_kernels_in_the_model_match_unfused(
    arch: str, dtype: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton kernels (interpreter) run inside the model: fused and unfused engines,
    both on the Triton norms and rope, agree to the kernels' rounding (the interpreter's
    exp is numpy's, so SiLU may differ from torch's by an ulp)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (unset on GPU machines)")
    for name in ("rms_norm", "apply_rope", *FUSED_OPS):
        monkeypatch.setattr(
            kernels, name, functools.partial(getattr(kernels, name), backend="triton")
        )
    fused = _engine(model_dirs[arch], fuse=True, dtype=dtype)
    plain = _engine(model_dirs[arch], fuse=False, dtype=dtype)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 0.02, "atol": 0.02}
    torch.testing.assert_close(fused.logits(PROMPT), plain.logits(PROMPT), **tolerance)
    fused_tokens, fused_rows = greedy_with_logits(fused, PROMPT, 3)
    plain_tokens, plain_rows = greedy_with_logits(plain, PROMPT, 3)
    assert fused_tokens == plain_tokens
    torch.testing.assert_close(fused_rows, plain_rows, **tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "phi3-partial-rotary", "gemma2", "qwen3-moe"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_fused_equals_unfused(arch: str, dtype: str, model_dirs: dict[str, Path]) -> None:
    """On the GPU every fused kernel rounds as the ops it replaces: prefill logits (eager)
    and greedy decode (CUDA graphs where the architecture captures) of fused and unfused
    engines are equal bit for bit."""
    # Graphs are asked for everywhere: an MoE's host loop over experts cannot be captured,
    # so Engine.load leaves those models eager (and must not fail to load them).
    graphs = arch != "qwen3-moe"
    options = dict(device="cuda", dtype=dtype, cuda_graphs=True)
    fused = _engine(model_dirs[arch], fuse=True, **options)
    plain = _engine(model_dirs[arch], fuse=False, **options)
    assert (fused.graphs is not None) == graphs
    assert torch.equal(fused.logits(PROMPT), plain.logits(PROMPT))
    fused_tokens, fused_rows = greedy_with_logits(fused, PROMPT, STEPS)
    plain_tokens, plain_rows = greedy_with_logits(plain, PROMPT, STEPS)
    assert fused_tokens == plain_tokens
    assert torch.equal(fused_rows, plain_rows)
