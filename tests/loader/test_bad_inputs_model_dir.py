"""Bad model directories through `loader.load`: damaged safetensors (bytes and header),
tensors of the wrong dtype, shape or value, broken shard indexes, bad config.json values,
broken tokenizers. Each is refused with the error type and a message naming the file and
tensor or key; a model loaded before keeps serving.

NaN/inf weights are refused (not warned about): such a model only ever answers garbage.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import loader
from engine.config import ConfigError
from engine.tokenizer import TokenizerError
from engine.weights import WeightError, WeightStore
from helpers.bad_inputs import (
    DROP,
    Serving,
    cases,
    copy_model,
    edit_config,
    read_safetensors_header,
    write_safetensors_raw,
)
from helpers.model_factory import make_tiny_llama

ST = "model.safetensors"
UP = "model.layers.1.mlp.up_proj.weight"  # [160, 64] in the tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad-inputs") / "tiny"
    make_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def serving(tiny: Path) -> Serving:
    return Serving(tiny)


def _refused(path: Path, error: type[Exception], match: str, serving: Serving) -> str:
    with pytest.raises(error, match=match) as caught:
        loader.load(path, "kestrel", device="cpu", max_seq_len=64)
    serving.check()
    return str(caught.value)


# -- safetensors bytes and header ---------------------------------------------------------


def _cut(fraction: float) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        f = path / ST
        data = f.read_bytes()
        f.write_bytes(data[: int(len(data) * fraction)])

    return damage


def _cut_in_header(path: Path) -> None:
    f = path / ST
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    f.write_bytes(data[: 8 + n // 2])


def _bytes(content: bytes) -> Callable[[Path], None]:
    return lambda path: (path / ST).write_bytes(content)


def _header_length(value: int) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        f = path / ST
        data = f.read_bytes()
        f.write_bytes(struct.pack("<Q", value) + data[8:])

    return damage


def _garbage_header(garbage: bytes) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        f = path / ST
        data = f.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        f.write_bytes(data[:8] + (garbage * n)[:n] + data[8 + n :])

    return damage


def _header(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        header, data = read_safetensors_header(path / ST)
        write_safetensors_raw(path / ST, edit(header), data)

    return damage


def _entry(**changes: object) -> Callable[[Path], None]:
    def edit(header: dict) -> dict:
        header[UP] = {**header[UP], **changes}
        return header

    return _header(edit)


def _set_entry(value: object) -> Callable[[dict], dict]:
    def edit(header: dict) -> dict:
        header[UP] = value
        return header

    return edit


SAFETENSORS_CASES = [
    ("truncated-at-90%", _cut(0.9), r"model\.safetensors is truncated: tensor '.*'"),
    ("truncated-at-50%", _cut(0.5), r"model\.safetensors is truncated: tensor '.*'"),
    ("truncated-in-header", _cut_in_header, r"model\.safetensors: corrupt or truncated"),
    ("truncated-to-4-bytes", _cut(4 / 2**30), r"model\.safetensors: not a safetensors file"),
    ("empty-file", _bytes(b""), r"model\.safetensors: not a safetensors file \(only 0 bytes"),
    ("header-length-2^63", _header_length(2**63), r"model\.safetensors: corrupt or truncated"),
    ("header-length-0", _header_length(0), r"model\.safetensors: corrupt safetensors header"),
    ("header-not-json", _garbage_header(b"{{not json"), r"model\.safetensors: corrupt .*header"),
    ("header-not-utf8", _garbage_header(b"\xff\xfe"), r"model\.safetensors: corrupt .*header"),
    ("header-a-list", _header(lambda h: list(h)), r"model\.safetensors: .*a JSON list, not an"),
    ("entry-not-object", _header(_set_entry(7)), rf"model\.safetensors: tensor '{UP}' .*entry 7"),
    ("dtype-unknown", _entry(dtype="F4"), rf"tensor '{UP}' has dtype 'F4'.*known: F64"),
    ("dtype-missing", _entry(dtype=None), rf"tensor '{UP}' has dtype None"),
    ("shape-negative", _entry(shape=[-160, 64]), rf"tensor '{UP}'.*shape \[-160, 64\]"),
    ("shape-float", _entry(shape=[160.0, 64]), rf"tensor '{UP}'.*shape \[160.0, 64\]"),
    ("shape-string", _entry(shape="160x64"), rf"tensor '{UP}'.*shape '160x64'"),
    ("offsets-negative", _entry(data_offsets=[-4, 10]), rf"tensor '{UP}'.*data_offsets \[-4"),
    ("offsets-one-number", _entry(data_offsets=[0]), rf"tensor '{UP}'.*data_offsets \[0\]"),
    ("size-disagrees", _entry(shape=[161, 64]), rf"tensor '{UP}' \(F32 \[161, 64\]\) needs"),
    (
        "offsets-past-end",
        _entry(data_offsets=[2**40, 2**40 + 160 * 64 * 4]),
        rf"model\.safetensors is truncated: tensor '{UP}' ends at byte",
    ),
]


@cases("damage, match", SAFETENSORS_CASES)
def test_damaged_safetensors(tiny, tmp_path, serving, damage, match):
    path = copy_model(tiny, tmp_path / "m")
    damage(path)
    message = _refused(path, WeightError, match, serving)
    assert str(path / ST) in message


# -- tensors that parse but do not fit --------------------------------------------------


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
        tensors[name][3, 5] = value

    return edit


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.pop(name)


TENSOR_CASES = [
    (
        "wrong-shape",
        _set(UP, torch.zeros(10, 64)),
        {},
        rf"'{UP}' .*\[10, 64\].*expects \[160, 64\]",
    ),
    ("wrong-shape-transposed", _set(UP, torch.zeros(64, 160)), {}, rf"'{UP}'.*\[64, 160\].*\[160"),
    ("wrong-rank", _set(UP, torch.zeros(160 * 64)), {}, rf"'{UP}' .*\[10240\].*\[160, 64\]"),
    ("dtype-int32", _set(UP, torch.zeros(160, 64, dtype=torch.int32)), {}, rf"'{UP}'.*int32"),
    ("dtype-bool", _set(UP, torch.zeros(160, 64, dtype=torch.bool)), {}, rf"'{UP}'.*dtype bool"),
    ("dtype-uint8", _set(UP, torch.zeros(160, 64, dtype=torch.uint8)), {}, rf"'{UP}'.*uint8"),
    ("missing-tensor", _drop(UP), {}, rf"tensor '{UP}' not found in"),
    ("missing-lm-head", _drop("lm_head.weight"), {}, r"'lm_head.weight' not found.*tie_word"),
    ("nan-weight", _poke(UP, float("nan")), {}, rf"'{UP}' in model\.safetensors holds 1 NaN"),
    ("inf-weight", _poke(UP, float("inf")), {}, rf"'{UP}' in model\.safetensors holds 1 NaN"),
    (
        "nan-norm",
        _set("model.norm.weight", torch.full((64,), float("nan"))),
        {},
        r"'model\.norm\.weight' .* holds 64 NaN or infinite values of 64",
    ),
    (
        "overflows-float16",
        _poke(UP, 1e6),
        {"dtype": "float16"},
        rf"'{UP}' .* 1 values beyond the range of float16 .*1e\+06.*bfloat16",
    ),
]


@cases("edit, options, match", TENSOR_CASES)
def test_tensor_that_does_not_fit(tiny, tmp_path, serving, edit, options, match):
    path = copy_model(tiny, tmp_path / "m")
    _tensors(edit)(path)
    with pytest.raises(WeightError, match=match):
        loader.load(path, "kestrel", device="cpu", max_seq_len=64, **options)
    serving.check()


def test_large_but_finite_float32_weight_loads(tiny, tmp_path, serving):
    """The overflow check is about the cast: in float32 the same weight is fine."""
    path = copy_model(tiny, tmp_path / "m")
    _tensors(_poke(UP, 1e6))(path)
    model = loader.load(path, "kestrel", device="cpu", max_seq_len=64, dtype="float32")
    assert model.logits([5, 6]).shape == (2, 384)
    serving.check()


# -- shard indexes and pickles ----------------------------------------------------------


def _shard(path: Path, index: object, outside: Path | None = None) -> None:
    """Move the weights into shard-1.safetensors and write `index` as the index JSON."""
    (path / ST).rename(path / "shard-1.safetensors")
    if outside is not None:  # a real safetensors file where the bad name points
        outside.parent.mkdir(parents=True, exist_ok=True)
        outside.write_bytes((path / "shard-1.safetensors").read_bytes())
    text = index if isinstance(index, str) else json.dumps(index)
    (path / "model.safetensors.index.json").write_text(text)


def _index_to(name: str) -> dict:
    return {"weight_map": {UP: name, "model.norm.weight": "shard-1.safetensors"}}


INDEX_CASES = [
    ("index-not-json", "{weight_map:", None, r"cannot read .*model\.safetensors\.index\.json"),
    ("index-no-weight-map", {"metadata": {}}, None, r"index\.json: 'weight_map'"),
    ("index-weight-map-list", {"weight_map": ["a"]}, None, r"index\.json: 'weight_map' must be"),
    ("index-weight-map-empty", {"weight_map": {}}, None, r"index\.json: 'weight_map' must be"),
    ("index-missing-shard", _index_to("shard-2.safetensors"), None, r"missing shard.*shard-2"),
    ("index-shard-not-a-string", _index_to(5), None, r"index\.json: invalid shard name 5"),
    ("index-shard-a-list", _index_to(["x"]), None, r"index\.json: invalid shard name \['x'\]"),
    (
        "index-shard-dot-dot",
        _index_to("../evil.safetensors"),
        "evil.safetensors",
        r"index\.json: invalid shard name '\.\./evil\.safetensors': '\.\.' leaves",
    ),
    (
        "index-shard-absolute",
        _index_to("/tmp/kestrel-evil.safetensors"),
        None,
        r"index\.json: invalid shard name '/tmp/kestrel-evil.safetensors': an absolute path",
    ),
    (
        "index-shard-windows-absolute",
        _index_to("C:\\evil.safetensors"),
        None,
        r"index\.json: invalid shard name 'C:\\\\evil.safetensors': an absolute path",
    ),
]


@cases("index, outside, match", INDEX_CASES)
def test_bad_shard_index(tiny, tmp_path, serving, index, outside, match):
    path = copy_model(tiny, tmp_path / "m")
    _shard(path, index, tmp_path / outside if outside else None)
    _refused(path, WeightError, match, serving)


def test_one_shard_named_two_ways(tiny, tmp_path):
    # An index may spell one shard differently ("./shard-1..." and "shard-1..."): it is one
    # file, read once, not a tensor "in both" shards.
    path = copy_model(tiny, tmp_path / "m")
    _shard(path, _index_to("./shard-1.safetensors"))
    store = WeightStore(path)
    assert UP in store and "model.norm.weight" in store


def test_shard_symlink_escaping_the_model_directory(tiny, tmp_path, serving):
    path = copy_model(tiny, tmp_path / "m")
    _shard(path, _index_to("link.safetensors"), tmp_path / "elsewhere" / "w.safetensors")
    (path / "link.safetensors").symlink_to(tmp_path / "elsewhere" / "w.safetensors")
    _refused(path, WeightError, r"shard 'link\.safetensors' points outside", serving)


def test_tensor_in_two_shards(tiny, tmp_path, serving):
    path = copy_model(tiny, tmp_path / "m")
    tensors = load_file(path / ST)
    save_file({UP: tensors[UP]}, path / "extra.safetensors")
    _refused(path, WeightError, rf"tensor '{UP}' appears in both extra\.safetensors and", serving)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_pickle_checkpoint_refused(tiny, tmp_path, serving, name):
    path = copy_model(tiny, tmp_path / "m")
    (path / ST).rename(path / name)
    _refused(path, WeightError, rf"{name}: pickle checkpoints are not loaded", serving)


# -- config.json ------------------------------------------------------------------------

CONFIG_KEYS = ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
               "num_attention_heads"]  # fmt: skip
BAD_COUNTS = [("negative", -64), ("zero", 0), ("float", 64.5), ("string", "64"),
              ("bool", True), ("null", None), ("missing", DROP)]  # fmt: skip


@pytest.mark.parametrize("key", CONFIG_KEYS)
@pytest.mark.parametrize("value", [v for _, v in BAD_COUNTS], ids=[i for i, _ in BAD_COUNTS])
def test_bad_config_count(tiny, tmp_path, serving, key, value):
    path = copy_model(tiny, tmp_path / "m")
    edit_config(path, **{key: value})
    why = "is missing" if value is DROP else rf"must be a positive integer, got {value!r}"
    message = _refused(path, ConfigError, rf"'{key}' {why}", serving)
    assert str(path / "config.json") in message


HUGE = [
    ("hidden_size", 2**40, WeightError, r"'model\.embed_tokens\.weight' .*expects \[384, 1099"),
    ("vocab_size", 10**12, WeightError, r"'model\.embed_tokens\.weight' .*\[1000000000000, 64"),
    ("intermediate_size", 2**31, WeightError, r"'model\.layers\.0\.mlp\.gate_proj\.weight'"),
    ("num_hidden_layers", 3, WeightError, r"num_hidden_layers is 3, but the weights .* hold 2"),
    ("num_hidden_layers", 10**9, ConfigError, r"'num_hidden_layers' is 1000000000, more than"),
    ("num_attention_heads", 128, WeightError, r"q_proj\.weight' .*\[64, 64\].*\[2048, 64\]"),
    ("num_key_value_heads", 3, ConfigError, r"multiple of num_key_value_heads \(3\)"),
    ("num_key_value_heads", -2, ConfigError, r"'num_key_value_heads' must be a positive"),
    ("head_dim", -16, ConfigError, r"'head_dim' must be a positive integer, got -16"),
    ("head_dim", 8, WeightError, r"q_proj\.weight' .*expects \[32, 64\]"),
    ("max_position_embeddings", -5, ConfigError, r"'max_position_embeddings' must be a pos"),
    ("rms_norm_eps", "tiny", ConfigError, r"'rms_norm_eps' must be a positive number, got 'ti"),
    ("rms_norm_eps", float("nan"), ConfigError, r"'rms_norm_eps' must be a positive number"),
    ("rms_norm_eps", -1e-5, ConfigError, r"'rms_norm_eps' must be a positive number, got -1e"),
    ("rope_parameters", {"rope_theta": "big"}, ConfigError, r"'rope_theta' must be a posit"),
    ("rope_parameters", {"rope_theta": -1.0}, ConfigError, r"'rope_theta' .*, got -1\.0"),
    ("rope_parameters", 10000, ConfigError, r"'rope_parameters' must be an object, got 10000"),
    ("rope_scaling", "linear", ConfigError, r"'rope_scaling' must be an object, got 'linear'"),
    ("eos_token_id", "</s>", ConfigError, r"'eos_token_id' must be a token id .*'</s>'"),
    ("eos_token_id", [2, -1], ConfigError, r"'eos_token_id' must be a token id .*\[2, -1\]"),
    ("bos_token_id", 1.5, ConfigError, r"'bos_token_id' must be a token id .*1\.5"),
    ("architectures", [], ConfigError, r"'architectures' is missing or empty"),
    ("architectures", ["EvilForCausalLM"], ValueError, r"'EvilForCausalLM' is not supported"),
    ("architectures", [["Llama"]], ConfigError, r"'architectures' must be a list of class"),
]


@pytest.mark.parametrize(
    "key, value, error, match",
    HUGE,
    ids=[f"{k}={str(v)[:12]}" for k, v, *_ in HUGE],
)
def test_bad_config_value(tiny, tmp_path, serving, key, value, error, match):
    path = copy_model(tiny, tmp_path / "m")
    edit_config(path, **{key: value})
    _refused(path, error, match, serving)


CONFIG_FILES = [
    ("config-missing", None, r"no config\.json in .*/m"),
    ("config-empty", b"", r"cannot read .*/m/config\.json: Expecting value"),
    ("config-not-json", b"{hidden_size: 64", r"cannot read .*/m/config\.json: Expecting prop"),
    ("config-not-utf8", b'{"a": "\xff"}', r"cannot read .*/m/config\.json: 'utf-8' codec"),
    ("config-a-list", b"[1, 2]", r"/m/config\.json: expected a JSON object"),
]


@cases("content, match", CONFIG_FILES)
def test_bad_config_file(tiny, tmp_path, serving, content, match):
    path = copy_model(tiny, tmp_path / "m")
    if content is None:
        (path / "config.json").unlink()
    else:
        (path / "config.json").write_bytes(content)
    with pytest.raises((ConfigError, loader.LoaderError), match=match):
        loader.load(path, device="cpu", max_seq_len=64)  # loader picked from the files
    with pytest.raises((ConfigError, loader.LoaderError), match=match):
        loader.load(path, "kestrel", device="cpu", max_seq_len=64)
    serving.check()


# -- tokenizer files --------------------------------------------------------------------

TOKENIZER_CASES = [
    ("tokenizer-missing", "tokenizer.json", None, r"no tokenizer in .*tokenizer\.json"),
    ("tokenizer-garbage", "tokenizer.json", b"\x00garbage", r"tokenizer\.json: cannot load"),
    ("tokenizer-truncated", "tokenizer.json", "half", r"tokenizer\.json: cannot load"),
    ("tokenizer-wrong-json", "tokenizer.json", b'{"model": 5}', r"tokenizer\.json: cannot load"),
    ("tokenizer-config-garbage", "tokenizer_config.json", b"{", r"tokenizer_config\.json: not"),
    ("tokenizer-config-list", "tokenizer_config.json", b"[]", r"tokenizer_config\.json: expec"),
]


@cases("name, content, match", TOKENIZER_CASES)
def test_bad_tokenizer(tiny, tmp_path, serving, name, content, match):
    path = copy_model(tiny, tmp_path / "m")
    file = path / name
    if content is None:
        file.unlink()
    elif content == "half":
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
    else:
        file.write_bytes(content)
    _refused(path, TokenizerError, match, serving)
