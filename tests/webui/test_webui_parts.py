"""The web UI's parts that need no browser: sampler controls against SamplingSettings, presets,
crash-safe storage, saved chats, the command line, load options and prompt fitting."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from engine.sampling_settings import SamplingSettings, SamplingSettingsError
from serving.sessions import UserData
from serving.storage import StorageError, atomic_write_text, read_json, write_json
from webui import cli, load_options, sampler_controls
from webui.presets import BUILTIN, Presets


# -- sampler controls ---------------------------------------------------------------------
def test_every_sampling_setting_has_a_control_with_its_default():
    fields = {f.name for f in dataclasses.fields(SamplingSettings)}
    shown = set(sampler_controls.CONTROL_NAMES)
    assert fields - sampler_controls.NOT_SHOWN <= shown, fields - shown
    assert sampler_controls.validate(sampler_controls.defaults()) == SamplingSettings(
        extra={"truncation_length": 0, "grammar_string": ""}
    )


def test_the_grammar_box_is_checked_with_the_settings():
    grammar = 'root ::= "yes" | "no"'
    settings = sampler_controls.validate({**sampler_controls.defaults(), "grammar_string": grammar})
    assert settings.extra["grammar_string"] == grammar
    with pytest.raises(ValueError, match="grammar_string.*undefined-rule"):
        sampler_controls.validate(
            {**sampler_controls.defaults(), "grammar_string": 'root ::= "a" undefined-rule'}
        )
    assert "grammar_string" not in sampler_controls.PRESET_NAMES


@pytest.mark.parametrize("control", [c for c in sampler_controls.CONTROLS if c.kind == "slider"])
def test_slider_bounds_are_valid_settings(control):
    for bound in (control.minimum, control.maximum):
        values = {**sampler_controls.defaults(), control.name: bound}
        sampler_controls.validate(values)  # raises on an out-of-range bound


def test_bad_text_boxes_name_their_key():
    with pytest.raises(ValueError, match="logit_bias"):
        sampler_controls.validate({**sampler_controls.defaults(), "logit_bias": "{oops"})
    with pytest.raises(SamplingSettingsError, match="custom_stopping_strings"):
        sampler_controls.validate(
            {**sampler_controls.defaults(), "custom_stopping_strings": '"unclosed'}
        )
    state = sampler_controls.state_from_values(
        {**sampler_controls.defaults(), "logit_bias": '{"5": -2.5}'}
    )
    assert SamplingSettings.from_any(state).logit_bias == {5: -2.5}


# -- presets ------------------------------------------------------------------------------
def test_builtin_presets_are_valid_and_start_from_defaults(tmp_path):
    presets = Presets(tmp_path)
    defaults = sampler_controls.defaults()
    for name, overrides in BUILTIN.items():
        values = presets.load(name)
        assert set(values) == set(sampler_controls.PRESET_NAMES)
        assert values == {n: overrides.get(n, defaults[n]) for n in values}
    assert "max_new_tokens" not in sampler_controls.PRESET_NAMES


def test_preset_round_trip_writes_only_differences(tmp_path):
    presets = Presets(tmp_path / "presets")
    values = {**sampler_controls.defaults(), "temperature": 0.55, "top_k": 33.0, "seed": 7}
    path = presets.save("mine", values)
    # Only the samplers that differ: the seed is not a preset's business.
    assert yaml.safe_load(path.read_text()) == {"temperature": 0.55, "top_k": 33}
    assert "mine" in presets.names()
    loaded = presets.load("mine")
    assert loaded["temperature"] == 0.55 and loaded["top_k"] == 33 and "seed" not in loaded
    assert loaded["top_p"] == sampler_controls.defaults()["top_p"]
    presets.delete("mine")
    assert "mine" not in presets.names()


def test_preset_errors_are_clear(tmp_path):
    presets = Presets(tmp_path)
    with pytest.raises(StorageError, match="built-in"):
        presets.save("Default", sampler_controls.defaults())
    with pytest.raises(StorageError, match="invalid preset name"):
        presets.save("../escape", sampler_controls.defaults())
    (tmp_path / "typo.yaml").write_text("temprature: 0.5\n")
    with pytest.raises(StorageError, match="temprature"):
        presets.load("typo")
    (tmp_path / "length.yaml").write_text("max_new_tokens: 5\n")
    with pytest.raises(StorageError, match="max_new_tokens"):
        presets.load("length")
    (tmp_path / "bad.yaml").write_text("top_p: 0\n")
    with pytest.raises(SamplingSettingsError, match="top_p"):
        presets.load("bad")


# -- storage ------------------------------------------------------------------------------
def test_concurrent_saves_never_tear_the_file(tmp_path):
    path = tmp_path / "chat.json"
    write_json(path, {"writer": -1, "payload": ""})
    stop = threading.Event()
    seen: list[int] = []

    def reader():
        while not stop.is_set():
            data = read_json(path)  # raises on a torn file
            assert len(data["payload"]) == (0 if data["writer"] < 0 else 200_000)
            seen.append(data["writer"])

    def writer(i: int):
        for _ in range(5):
            write_json(path, {"writer": i, "payload": str(i % 10) * 200_000})

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    r.join()
    final = read_json(path)
    assert final["payload"] == str(final["writer"] % 10) * 200_000
    assert seen, "the reader never ran"
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


def _write_forever(path: str) -> None:
    i = 0
    while True:
        atomic_write_text(Path(path), json.dumps({"i": i, "pad": "x" * 500_000}))
        i += 1


def test_a_killed_writer_leaves_a_whole_file(tmp_path):
    path = tmp_path / "settings.json"
    write_json(path, {"i": -1, "pad": ""})
    proc = multiprocessing.get_context("fork").Process(target=_write_forever, args=(str(path),))
    proc.start()
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    data = read_json(path)  # never a half-written file
    assert data["i"] >= -1 and len(data["pad"]) in (0, 500_000)


def test_saved_chats_round_trip_and_reject_bad_data(tmp_path):
    user = UserData(tmp_path)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    user.save_chat("first", messages, "Be brief.")
    time.sleep(0.01)
    user.save_chat("second", messages[:1])
    assert user.chat_names() == ["second", "first"]
    assert user.load_chat("first") == (messages, "Be brief.")
    with pytest.raises(StorageError, match="message 0"):
        user.save_chat("bad", [{"role": "robot", "content": "x"}])
    with pytest.raises(StorageError, match="invalid chat name"):
        user.load_chat("../../etc/passwd")
    (tmp_path / "chats" / "broken.json").write_text("{not json")
    with pytest.raises(StorageError, match="broken.json"):
        user.load_chat("broken")
    user.update_settings(preset="min_p")
    user.update_settings(system_prompt="S")
    assert user.load_settings() == {"preset": "min_p", "system_prompt": "S"}


# -- command line and load options ----------------------------------------------------------
def test_cli_defaults_are_local_and_private():
    args = cli.parse_args([])
    assert cli.host(args) == "127.0.0.1" and args.share is False and args.port == 7860
    assert cli.load_options(args) == {}
    args = cli.parse_args(
        [
            "--listen",
            "--max_seq_len",
            "4096",
            "--cache-type",
            "q4",
            "--gpu-split",
            "20, 24",
            "--autosplit",
            "--tp",
            "--rope-alpha",
            "2.5",
            "--nowebui",
        ]
    )
    assert cli.host(args) == "0.0.0.0" and args.api is True
    assert cli.load_options(args) == {
        "max_seq_len": 4096,
        "cache_type": "q4",
        "gpu_split": [20.0, 24.0],
        "autosplit": True,
        "tensor_parallel": True,
        "rope_alpha": 2.5,
    }


def test_gpu_split_errors_name_the_bad_part():
    with pytest.raises(ValueError, match="'twenty'"):
        cli.parse_gpu_split("20,twenty")
    with pytest.raises(ValueError, match="more than 0"):
        cli.parse_gpu_split("20,0")
    with pytest.raises(SystemExit):
        cli.parse_args(["--gpu-split", "x"])


def test_load_kwargs_send_only_what_was_set():
    assert load_options.load_kwargs(dict(load_options.NEUTRAL)) == {}
    values = {
        **load_options.NEUTRAL,
        "max_seq_len": 2048,
        "cache_type": "q8",
        "gpu_split": "10,10",
        "rope_scale": 2.0,
        "device": "cpu",
        "dtype": "float32",
    }
    kwargs = load_options.load_kwargs(values)
    assert kwargs == {
        "max_seq_len": 2048,
        "cache_type": "q8",
        "gpu_split": [10.0, 10.0],
        "rope_scale": 2.0,
        "device": "cpu",
        "dtype": "float32",
    }
    assert load_options.values_from_kwargs(kwargs)["gpu_split"] == "10,10"
    # Controls the chosen loader does not show are never sent.
    assert load_options.load_kwargs(values, {"device", "dtype"}) == {
        "device": "cpu",
        "dtype": "float32",
    }


# -- issue 24: names, revisions, no lock files, load checks ---------------------------------
def test_chat_names_are_unique_and_saves_never_overwrite_another_page(tmp_path):
    from serving.sessions import new_chat_name

    names = {new_chat_name() for _ in range(200)}  # same second, every one different
    assert len(names) == 200
    user = UserData(tmp_path)
    first = user.save_chat("c1", [{"role": "user", "content": "Tell me\n about  whales"}], "", None)
    assert (first.name, first.revision, first.forked) == ("c1", 1, False)
    two_turns = [{"role": "user", "content": "Tell me\n about  whales"}]
    # Page A saw revision 1 and saves; page B, which also saw 1, then goes to a new chat.
    a = user.save_chat("c1", [*two_turns, {"role": "assistant", "content": "A"}], "", 1)
    b = user.save_chat("c1", [*two_turns, {"role": "assistant", "content": "B"}], "", 1)
    assert (a.name, a.revision, a.forked) == ("c1", 2, False)
    assert b.forked and b.name != "c1" and b.revision == 1
    assert user.load_chat("c1")[0][-1]["content"] == "A"
    assert user.load_chat(b.name)[0][-1]["content"] == "B"
    labels = dict((name, label) for label, name in user.chat_choices())
    assert labels["c1"].startswith("Tell me about whales · ")
    assert user.latest_chat() in ("c1", b.name)


def test_a_renamed_chat_is_saved_as_one_the_page_never_saw(tmp_path):
    from webui.chat_tab import seen_revision

    user = UserData(tmp_path)
    user.save_chat("other", [{"role": "user", "content": "keep me"}], "", None)
    mine = user.save_chat("mine", [{"role": "user", "content": "mine"}], "", None)
    saved_at = (mine.name, mine.revision)  # both chats at revision 1
    assert seen_revision(saved_at, "mine") == seen_revision(saved_at, " mine ") == 1
    assert seen_revision(saved_at, "other") is None and seen_revision(None, "mine") is None
    # Renamed onto "other": saved as a new chat, never over the one the page did not see.
    turns = [{"role": "user", "content": "mine"}, {"role": "assistant", "content": "x"}]
    moved = user.save_chat("other", turns, "", seen_revision(saved_at, "other"))
    assert moved.forked and moved.name not in ("other", "mine")
    assert user.load_chat("other")[0] == [{"role": "user", "content": "keep me"}]


def test_names_too_long_or_with_forbidden_characters_are_refused_and_no_lock_files(tmp_path):
    user = UserData(tmp_path)
    with pytest.raises(StorageError, match="at most 200 bytes"):
        user.save_chat("€" * 100, [{"role": "user", "content": "x"}])  # 300 bytes
    with pytest.raises(StorageError, match="invalid preset name 'my preset!'"):
        Presets(tmp_path / "presets").save("my preset!", sampler_controls.defaults())
    Presets(tmp_path / "presets").save("my preset (v2)", sampler_controls.defaults())
    user.save_chat("kept", [{"role": "user", "content": "x"}])
    user.update_settings(preset="min_p")
    left = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["kept.json", "my preset (v2).yaml", "settings.yaml"], left


def test_cli_takes_threads_and_share():
    args = cli.parse_args(["--threads", "3", "--share"])
    assert args.threads == 3 and args.share is True
    with pytest.raises(SystemExit):
        cli.parse_args(["--threads", "0"])


def test_load_check_names_the_option_and_the_file(tmp_path):
    from helpers.model_factory import make_tiny_llama
    from loader.manager import ModelManager
    from webui.load_check import LoadCheckError, check_load

    make_tiny_llama(tmp_path / "tiny", max_position_embeddings=256)
    manager = ModelManager(tmp_path)
    assert check_load(manager, "tiny", None, {"max_seq_len": 256}) == "kestrel"
    assert check_load(manager, "tiny", None, {"rope_scale": 2.0}) == "kestrel"
    with pytest.raises(LoadCheckError, match="the transformers loader does not take rope_scale"):
        check_load(manager, "tiny", "transformers", {"rope_scale": 2.0})
    weights = tmp_path / "tiny" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(LoadCheckError, match="model.safetensors is not a readable"):
        check_load(manager, "tiny", None, {})


def test_page_updates_are_spaced_by_the_reply_length():
    from webui.generation import MIN_UPDATE_SECONDS, update_interval
    from webui.model_tab import size_text

    assert update_interval(10) == MIN_UPDATE_SECONDS
    assert update_interval(40_000) > update_interval(4_000) > MIN_UPDATE_SECONDS
    assert size_text(3_100_000) == "3.1 MB" and size_text(540_000_000) == "540 MB"
