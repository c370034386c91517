"""Fuzzing the file readers with hypothesis: random safetensors header bytes and JSON,
random config.json values, random adapter_config.json values. Whatever the input, a load
either succeeds or raises a ValueError subclass whose message names the file; never
another exception type (a crash), and the model loaded before keeps serving.

Example counts are small (the whole file runs in well under a minute on two cores); the
seeds are fixed by hypothesis's database-free derandomized mode, so CI sees the same cases.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest

import loader
from engine.lora import LoraError
from helpers.bad_inputs import Serving, copy_model, read_safetensors_header, write_safetensors_raw
from helpers.model_factory import make_tiny_llama

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
UP = "model.layers.1.mlp.up_proj.weight"

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fuzz") / "tiny"
    make_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def serving(tiny: Path) -> Serving:
    return Serving(tiny)


@pytest.fixture(scope="module")
def scratch(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One working copy, restored before each example (copying per example is the cost)."""
    return copy_model(tiny, tmp_path_factory.mktemp("fuzz-work") / "m")


def _restore(tiny: Path, work: Path) -> None:
    for f in tiny.iterdir():
        shutil.copyfile(f, work / f.name)
    for f in work.iterdir():
        if not (tiny / f.name).exists():
            f.unlink()


def _load_or_clear_error(path: Path, serving: Serving, must_name: str) -> None:
    try:
        model = loader.load(path, "kestrel", device="cpu", max_seq_len=32)
    except ValueError as e:  # WeightError, ConfigError, TokenizerError, LoaderError, ...
        assert must_name in str(e), f"{type(e).__name__} does not name {must_name}: {e}"
    else:
        model.unload()
    serving.check()


@FUZZ
@given(data=st.binary(max_size=64), keep=st.integers(min_value=0, max_value=400))
def test_fuzzed_header_bytes(tiny, scratch, serving, data, keep):
    """The header's first `keep` bytes, then random bytes, with the length prefix kept."""
    _restore(tiny, scratch)
    f = scratch / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n]
    mutated = (header[:keep] + data + header[keep + len(data) :])[:n].ljust(n, b" ")
    f.write_bytes(raw[:8] + mutated + raw[8 + n :])
    # A renamed tensor is reported as missing from the directory; all else names the file.
    _load_or_clear_error(scratch, serving, str(scratch))


@FUZZ
@given(field=st.sampled_from(["dtype", "shape", "data_offsets"]), value=JSON_VALUES)
def test_fuzzed_header_entry(tiny, scratch, serving, field, value):
    _restore(tiny, scratch)
    f = scratch / "model.safetensors"
    header, data = read_safetensors_header(f)
    header[UP] = {**header[UP], field: value}
    write_safetensors_raw(f, header, data)
    _load_or_clear_error(scratch, serving, str(f))


CONFIG_KEYS = [
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_parameters", "rope_scaling", "eos_token_id", "bos_token_id",
    "tie_word_embeddings", "architectures", "sliding_window",
]  # fmt: skip


@FUZZ
@given(key=st.sampled_from(CONFIG_KEYS), value=JSON_VALUES)
def test_fuzzed_config_value(tiny, scratch, serving, key, value):
    _restore(tiny, scratch)
    config = json.loads((scratch / "config.json").read_text())
    config[key] = value
    (scratch / "config.json").write_text(json.dumps(config))
    # A refusal names config.json, or (when the value parses but does not fit the
    # weights) the tensor's file.
    try:
        model = loader.load(scratch, "kestrel", device="cpu", max_seq_len=32)
    except ValueError as e:
        assert "config.json" in str(e) or "model.safetensors" in str(e), f"{type(e)}: {e}"
    else:
        model.unload()
    serving.check()


@pytest.fixture(scope="module")
def adapter(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("fuzz-adapter") / "a"
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])).save_pretrained(
        path
    )
    return path


ADAPTER_KEYS = ["r", "lora_alpha", "peft_type", "use_dora", "bias", "rank_pattern",
                "alpha_pattern", "use_rslora", "target_modules"]  # fmt: skip


@FUZZ
@given(key=st.sampled_from(ADAPTER_KEYS), value=JSON_VALUES)
def test_fuzzed_adapter_config(adapter, serving, tmp_path_factory, key, value):
    work = tmp_path_factory.mktemp("fuzz-lora") / "a"
    copy_model(adapter, work)
    config = json.loads((work / "adapter_config.json").read_text())
    config[key] = value
    (work / "adapter_config.json").write_text(json.dumps(config))
    model = serving.model
    try:
        model.load_lora(work, "fuzzed")
    except LoraError as e:
        assert str(work) in str(e), e
    else:
        # Accepted: it must then apply with finite logits, and unload cleanly.
        logits = model.engine.logits([5, 6, 7], loras={"fuzzed": 1.0})
        assert all(math.isfinite(v) for v in logits.flatten().tolist())
        model.unload_lora("fuzzed")
    assert model.loras() == {}
    serving.check()
