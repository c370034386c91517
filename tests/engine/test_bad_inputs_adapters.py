"""Bad LoRA adapters through `LoadedModel.load_lora` on a loaded tiny model, and bad model
and LoRA names through `ModelManager` (the path the UI and the API take).

Each is refused with `LoraError` / `UnknownNameError` naming the file and tensor or key (or
the name); the model keeps serving, with no adapter left half loaded. NaN/inf adapter
weights are refused, as model weights are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from engine.lora import LoraError
from helpers.bad_inputs import Serving, cases, copy_model
from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager, UnknownNameError

CFG = "adapter_config.json"
ST = "adapter_model.safetensors"
A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"  # [4, 64]
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"  # [64, 4]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad-adapters") / "tiny"
    make_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def good_adapter(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("adapter") / "good"
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    get_peft_model(base, config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def serving(tiny: Path) -> Serving:
    return Serving(tiny)


def _refused(serving: Serving, path: Path, match: str) -> str:
    with pytest.raises(LoraError, match=match) as caught:
        serving.model.load_lora(path, "bad")
    assert serving.model.loras() == {}, "a refused adapter was left loaded"
    serving.check()
    return str(caught.value)


def test_good_adapter_loads_and_unloads(serving, good_adapter):
    """The damaged copies below start from this one: it must itself load."""
    serving.model.load_lora(good_adapter, "good")
    assert set(serving.model.loras()) == {"good"}
    serving.model.unload_lora("good")
    serving.check()


# -- adapter_config.json ------------------------------------------------------------------


def _config(**changes: object) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        config = json.loads((path / CFG).read_text())
        config.update(changes)
        (path / CFG).write_text(json.dumps(config))

    return damage


def _write(name: str, content: bytes | None) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        if content is None:
            (path / name).unlink()
        else:
            (path / name).write_bytes(content)

    return damage


CONFIG_CASES = [
    ("config-missing", _write(CFG, None), r"adapter_config\.json is missing"),
    ("config-empty", _write(CFG, b""), r"adapter_config\.json: cannot be read as JSON"),
    ("config-not-utf8", _write(CFG, b'{"r": "\xff"}'), r"adapter_config\.json: cannot be read"),
    ("config-a-list", _write(CFG, b"[4]"), r"adapter_config\.json: expected a JSON object"),
    ("r-zero", _config(r=0), r"adapter_config\.json: 'r' must be a positive integer, got 0"),
    ("r-negative", _config(r=-4), r"'r' must be a positive integer, got -4"),
    ("r-float", _config(r=4.5), r"'r' must be a positive integer, got 4\.5"),
    ("r-string", _config(r="4"), r"'r' must be a positive integer, got '4'"),
    ("r-nan", _config(r=float("nan")), r"'r' must be a positive integer, got nan"),
    (
        "r-huge",
        _config(r=10**9),
        r"'.*lora_A.*' has rank 4, adapter_config\.json says r=1000000000",
    ),
    ("alpha-nan", _config(lora_alpha=float("nan")), r"'lora_alpha' must be a positive number"),
    ("alpha-inf", _config(lora_alpha=float("inf")), r"'lora_alpha' must be a positive number"),
    ("alpha-bool", _config(lora_alpha=True), r"'lora_alpha' must be a positive number, got True"),
    ("peft-type", _config(peft_type="PREFIX_TUNING"), r"peft_type 'PREFIX_TUNING' is not a LoRA"),
    ("dora", _config(use_dora=True), r"use_dora is true; DoRA adapters are not supported"),
    ("bias", _config(bias="all"), r"bias 'all' is not supported"),
    ("rank-pattern-string", _config(rank_pattern={"q_proj": "8"}), r"'rank_pattern' gives .*'8'"),
    ("rank-pattern-list", _config(rank_pattern=[1]), r"'rank_pattern' must be an object"),
    ("rank-pattern-regex", _config(rank_pattern={"(": 4}), r"'rank_pattern' holds a bad pattern"),
    ("alpha-pattern-zero", _config(alpha_pattern={"q_proj": 0}), r"'alpha_pattern' gives .* 0,"),
]


@cases("damage, match", CONFIG_CASES)
def test_bad_adapter_config(serving, good_adapter, tmp_path, damage, match):
    path = copy_model(good_adapter, tmp_path / "bad")
    damage(path)
    assert str(path) in _refused(serving, path, match)


# -- adapter weights ----------------------------------------------------------------------


def _tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        tensors = load_file(path / ST)
        edit(tensors)
        save_file(tensors, path / ST)

    return damage


def _set(name: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.__setitem__(name, value)


def _poke(name: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].clone()
        tensors[name][1, 2] = value

    return edit


OTHER = "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"
OTHER_B = OTHER.replace("lora_A", "lora_B")
HEAD = "base_model.model.lm_head.weight"
TENSOR_CASES = [
    ("rank-3-vs-config-4", _set(A, torch.zeros(3, 64)), rf"'{A}' \(3, 64\) and '{B}' \(64, 4\)"),
    (
        "both-rank-3-vs-config-4",
        lambda t: t.update({A: torch.zeros(3, 64), B: torch.zeros(64, 3)}),
        rf"'{A}' has rank 3, adapter_config\.json says r=4 for",
    ),
    ("hidden-size-32", _set(A, torch.zeros(4, 32)), rf"'{A}' \(4, 32\) .* do not fit .*in 64"),
    ("out-size-128", _set(B, torch.zeros(128, 4)), rf"'{B}' \(128, 4\) do not fit .*out 64"),
    ("three-dims", _set(A, torch.zeros(4, 64, 1)), rf"'{A}' \(4, 64, 1\) .* not a \[r, in\]"),
    ("lora-a-without-b", lambda t: t.pop(B), rf"tensor '{A}' has no lora_B"),
    ("lora-b-without-a", lambda t: t.pop(A), rf"tensor '{B}' has no lora_A"),
    (
        "no-such-module",
        lambda t: t.update(
            {OTHER: torch.zeros(4, 64), OTHER.replace("A", "B"): torch.zeros(64, 4)}
        ),
        r"the model has no linear 'model\.layers\.9\.self_attn\.q_proj'",
    ),
    ("head-wrong-shape", _set(HEAD, torch.zeros(10, 64)), rf"'{HEAD}' has shape \(10, 64\), the"),
    ("stray-tensor", _set("something.else", torch.zeros(2)), r"'something\.else' is neither"),
    ("no-tensors", lambda t: t.clear(), r"holds no LoRA tensors"),
    ("nan", _poke(B, float("nan")), rf"tensor '{B}' holds 1 NaN or infinite values"),
    ("inf", _poke(A, float("-inf")), rf"tensor '{A}' holds 1 NaN or infinite values"),
    ("int-dtype", _set(A, torch.ones(4, 64, dtype=torch.int32)), rf"'{A}' has dtype int32, a"),
]


@cases("edit, match", TENSOR_CASES)
def test_bad_adapter_tensors(serving, good_adapter, tmp_path, edit, match):
    path = copy_model(good_adapter, tmp_path / "bad")
    _tensors(edit)(path)
    assert str(path / ST) in _refused(serving, path, match)


def _truncate(path: Path) -> None:
    data = (path / ST).read_bytes()
    (path / ST).write_bytes(data[: len(data) // 2])


FILE_CASES = [
    ("weights-missing", _write(ST, None), r"has neither adapter_model\.safetensors nor .*\.bin"),
    ("weights-truncated", _truncate, r"adapter_model\.safetensors: cannot be read"),
    ("weights-garbage", _write(ST, b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}"), r"cannot be"),
    ("weights-empty", _write(ST, b""), r"adapter_model\.safetensors: cannot be read"),
]


@cases("damage, match", FILE_CASES)
def test_bad_adapter_files(serving, good_adapter, tmp_path, damage, match):
    path = copy_model(good_adapter, tmp_path / "bad")
    damage(path)
    assert str(path) in _refused(serving, path, match)


def test_adapter_directory_missing(serving, tmp_path):
    _refused(serving, tmp_path / "nowhere", r"LoRA adapter directory .*nowhere does not exist")


class _Exploit:
    """Unpickling this would run code (it writes a marker file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def _pickle(payload: Callable[[Path, dict[str, torch.Tensor]], object]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        tensors = load_file(path / ST)
        (path / ST).unlink()
        torch.save(payload(path, tensors), path / "adapter_model.bin")

    return damage


PICKLE_CASES = [
    ("pickle-runs-code", lambda p, t: {A: _Exploit(p / "pwned")}, r"refused.*weights_only"),
    ("pickle-a-list", lambda p, t: list(t.values()), r"expected a dict of tensor names"),
    ("pickle-non-tensor", lambda p, t: {**t, A: "text"}, r"expected a dict of tensor names"),
]


@cases("payload, match", PICKLE_CASES)
def test_pickled_adapter(serving, good_adapter, tmp_path, payload, match):
    path = copy_model(good_adapter, tmp_path / "bad")
    _pickle(payload)(path)
    assert str(path / "adapter_model.bin") in _refused(serving, path, match)
    assert not (path / "pwned").exists(), "unpickling ran code"


def test_truncated_pickle_is_refused(serving, good_adapter, tmp_path):
    path = copy_model(good_adapter, tmp_path / "bad")
    _pickle(lambda p, t: t)(path)
    data = (path / "adapter_model.bin").read_bytes()
    (path / "adapter_model.bin").write_bytes(data[: len(data) // 2])
    _refused(serving, path, r"adapter_model\.bin: refused")


# -- names from the UI and the API --------------------------------------------------------

BAD_NAMES = [
    ("dot-dot", "..", r"invalid LoRA name '\.\.'"),
    ("dot", ".", r"invalid LoRA name '\.'"),
    ("empty", "", r"invalid LoRA name ''"),
    ("parent-path", "../good", r"invalid LoRA name '\.\./good': a name is one entry"),
    ("deep-parent", "../../../../etc", r"invalid LoRA name '\.\./\.\./\.\./\.\./etc'"),
    ("absolute", "/etc", r"invalid LoRA name '/etc': an absolute path"),
    ("subdir", "good/sub", r"invalid LoRA name 'good/sub': a name is one entry"),
    ("backslash", "..\\good", r"invalid LoRA name '\.\.\\\\good'"),
    ("windows-drive", "C:\\loras", r"invalid LoRA name 'C:\\\\loras': an absolute path"),
    ("nul-byte", "good\x00", r"invalid LoRA name 'good\\x00'"),
    ("not-a-string", 5, r"invalid LoRA name 5"),
    ("not-there", "nothing", r"no LoRA named 'nothing' in"),
]


@pytest.fixture
def manager(tmp_path: Path, tiny: Path, good_adapter: Path) -> ModelManager:
    models, loras = tmp_path / "models", tmp_path / "loras"
    copy_model(tiny, models / "tiny")
    copy_model(good_adapter, loras / "good")
    outside = copy_model(good_adapter, tmp_path / "outside-lora")
    (loras / "escape").symlink_to(outside, target_is_directory=True)
    (models / "escape").symlink_to(tiny, target_is_directory=True)
    return ModelManager(models, loras)


@cases("name, match", BAD_NAMES)
def test_bad_lora_name(manager, name, match):
    with pytest.raises(UnknownNameError, match=match):
        manager.resolve_lora(name)


@pytest.mark.parametrize(
    "name, match",
    [(n, m.replace("LoRA", "model")) for _, n, m in BAD_NAMES],
    ids=[c[0] for c in BAD_NAMES],
)
def test_bad_model_name_keeps_the_current_model(manager, name, match):
    model = manager.load("tiny", device="cpu", max_seq_len=64)
    answer = model.generate([5, 6, 7], {"temperature": 0, "max_new_tokens": 3})
    with pytest.raises(UnknownNameError, match=match):
        manager.load(name, device="cpu")
    assert manager.name == "tiny" and manager.current() is model
    assert model.generate([5, 6, 7], {"temperature": 0, "max_new_tokens": 3}) == answer


def test_symlinks_escaping_their_directory(manager):
    with pytest.raises(UnknownNameError, match=r"LoRA 'escape' points outside .*loras"):
        manager.resolve_lora("escape")
    with pytest.raises(UnknownNameError, match=r"model 'escape' points outside .*models"):
        manager.resolve_model("escape")
    assert manager.resolve_lora("good").name == "good"


DRAFTS = [
    ("../tiny", r"invalid draft model name '\.\./tiny'"),
    ("/etc", r"invalid draft model name '/etc': an absolute path"),
    ("escape", r"draft model 'escape' points outside"),
    ("missing", r"no draft model named 'missing' in"),
]


@pytest.mark.parametrize("draft, match", DRAFTS, ids=[d for d, _ in DRAFTS])
def test_draft_model_name_is_confined(manager, draft, match):
    """draft_model comes from the Model tab and the API as text: a name, never a path."""
    model = manager.load("tiny", device="cpu", max_seq_len=64)
    with pytest.raises(UnknownNameError, match=match):
        manager.load("tiny", device="cpu", max_seq_len=64, draft_model=draft)
    assert manager.current() is model


def test_draft_model_by_name_loads(manager):
    model = manager.load("tiny", device="cpu", max_seq_len=64, draft_model="tiny")
    assert model.info()["draft_model"].endswith("models/tiny")
