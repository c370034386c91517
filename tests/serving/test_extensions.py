"""serving.extensions (TGW's script.py contract) and serving.text_generation (the shared flow).

Extensions here are real script.py files written to a temporary directory; generation
runs on a tiny random Llama through the kestrel loader. With KESTREL_TGW_PATH pointing at
a text-generation-webui checkout, TGW's own extensions are copied and run unchanged.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import loader
from helpers.model_factory import make_tiny_llama
from serving import extensions, shared
from serving.text_generation import (
    generate_chat_reply,
    generate_reply,
    prepare_chat,
    stream_reply,
)

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ban_eos_token": True}

# Each hook appends the extension's tag, so the result shows which ran and in what order.
RECORDER = """
calls = []
params = {{"tag": "{tag}", "is_tab": False}}
setup_count = 0

def setup():
    global setup_count
    setup_count += 1

def input_modifier(string, state, is_chat=False):
    calls.append(("input", is_chat))
    return string + "<in:" + params["tag"] + ">"

def output_modifier(string, state, is_chat=False):
    calls.append(("output", is_chat))
    return string + "<out:" + params["tag"] + ">"

def state_modifier(state):
    state = dict(state)
    state["order"] = state.get("order", "") + params["tag"]
    return state

def history_modifier(history):
    return history + [{{"role": "user", "content": "from " + params["tag"]}}]

def bot_prefix_modifier(string, state):
    return string + "[" + params["tag"] + "]"

def custom_css():
    return "/*" + params["tag"] + "*/"

def custom_js():
    return "//" + params["tag"]
"""

# TGW's oldest signature: one argument, no state, no is_chat.
OLD_STYLE = """
def input_modifier(string):
    return string.upper()
"""

ECHO = """
def custom_generate_reply(question, original_question, state, stopping_strings, is_chat=False):
    for i in range(1, len(question) + 1):
        yield question[:i]
"""


def _write(root: Path, name: str, source: str) -> None:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "script.py").write_text(textwrap.dedent(source), encoding="utf-8")


@pytest.fixture
def ext_dir(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "extensions"
    _write(root, "alpha", RECORDER.format(tag="A"))
    _write(root, "beta", RECORDER.format(tag="B"))
    _write(root, "old_style", OLD_STYLE)
    _write(root, "echo", ECHO)
    _write(root, "broken", "raise RuntimeError('boom at import')\n")
    _write(root, "bad_setup", "def setup():\n    raise KeyError('missing key')\n")
    _write(root, "needs_pkg", "import kestrel_no_such_package\n")
    (root / "needs_pkg" / "requirements.txt").write_text("kestrel-no-such-package\n")
    yield root
    extensions.load_extensions([])
    shared.settings.clear()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[loader.base.LoadedModel]:
    path = tmp_path_factory.mktemp("models") / "tiny"
    make_tiny_llama(path)
    model = loader.load(
        path, "kestrel", device="cpu", dtype="float32", page_size=16, cache_tokens=512
    )
    shared.manager.adopt(model, "tiny")
    yield model
    shared.manager.unload()


def test_hooks_run_in_the_given_order(ext_dir: Path) -> None:
    loaded = extensions.load_extensions(["beta", "alpha"], ext_dir)
    assert [e.name for e in loaded] == ["beta", "alpha"]
    state = {"x": 1}
    assert extensions.apply_input_modifier("hi", state) == "hi<in:B><in:A>"
    assert extensions.apply_output_modifier("r", state, is_chat=True) == "r<out:B><out:A>"
    assert extensions.apply_state_modifier(state)["order"] == "BA"
    assert extensions.apply_bot_prefix_modifier("", state) == "[B][A]"
    history = extensions.apply_history_modifier([])
    assert [m["content"] for m in history] == ["from B", "from A"]
    assert extensions.custom_css() == "/*B*//*A*/"
    assert extensions.custom_js() == "//B//A"
    assert extensions.custom_generate_reply() is None
    alpha = loaded[1].module
    assert alpha.calls == [("input", False), ("output", True)]


def test_old_signatures_and_first_custom_generate_reply(ext_dir: Path) -> None:
    extensions.load_extensions(["old_style", "echo", "alpha"], ext_dir)
    assert extensions.apply_input_modifier("abc", {}) == "ABC<in:A>"
    custom = extensions.custom_generate_reply()
    assert custom is not None and custom.__module__.endswith("echo.script")


def test_params_overridden_by_settings_and_setup_runs_once(ext_dir: Path) -> None:
    shared.settings["alpha-tag"] = "Z"
    (alpha,) = extensions.load_extensions(["alpha"], ext_dir)
    assert alpha.params["tag"] == "Z"
    assert extensions.apply_input_modifier("", {}) == "<in:Z>"
    extensions.load_extensions(["alpha"], ext_dir)
    assert alpha.module.setup_count == 1


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing", "extension 'missing' not found"),
        ("broken", "extension 'broken' failed to import"),
        ("bad_setup", "extension 'bad_setup': setup() failed: KeyError"),
        ("needs_pkg", "No module named 'kestrel_no_such_package'; install its requirements"),
        ("../alpha", "invalid extension name '../alpha'"),
        ("a/b", "invalid extension name 'a/b'"),
    ],
)
def test_bad_extension_is_named_and_skipped(
    ext_dir: Path, name: str, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        loaded = extensions.load_extensions(["alpha", name, "beta"], ext_dir)
    assert [e.name for e in loaded] == ["alpha", "beta"]
    assert message in caplog.text
    with pytest.raises(extensions.ExtensionError, match=re.escape(message)):
        extensions.load_extensions([name], ext_dir, strict=True)


def test_text_flow_order_with_custom_generate_reply(ext_dir: Path) -> None:
    # echo returns the (input-modified) prompt, so the result shows the whole chain.
    extensions.load_extensions(["alpha", "echo", "beta"], ext_dir)
    texts = list(generate_reply("q", {}))
    assert texts[-1] == "q<in:A><in:B><out:A><out:B>"
    # Intermediate items are the raw cumulative reply; output_modifier only on the last.
    assert texts[:-1] == ["q<in:A><in:B>"[:i] for i in range(1, len("q<in:A><in:B>") + 1)]


def test_word_replace_example(ext_dir: Path) -> None:
    shared.settings["word_replace-input_pairs"] = "colour=color; q=question"
    shared.settings["word_replace-output_pairs"] = "color=hue"
    # from the repository's extensions/ (imported as extensions.word_replace.script) ...
    (repo_copy,) = extensions.load_extensions(["word_replace"], None, strict=True)
    assert repo_copy.module.__name__ == "extensions.word_replace.script"
    assert repo_copy.params["output_pairs"] == "color=hue"
    # ... and as a file copied next to the echo extension, as a user would drop it in
    _write(
        ext_dir,
        "word_replace",
        (extensions.DEFAULT_EXTENSIONS_DIR / "word_replace" / "script.py").read_text(),
    )
    loaded = extensions.load_extensions(["word_replace", "echo"], ext_dir)
    assert loaded[0].params["input_pairs"] == "colour=color; q=question"
    # input: colour -> color, q -> question (whole words only); output: color -> hue
    assert list(generate_reply("colour q qq", {}))[-1] == "hue question qq"


def test_model_flow_streams_and_modifies_final(ext_dir: Path, tiny_model) -> None:
    extensions.load_extensions(["alpha"], ext_dir)
    expected = tiny_model.generate("Once upon<in:A>", GREEDY)
    chunks = list(stream_reply("Once upon", GREEDY))
    assert "".join(c.delta for c in chunks) == expected
    assert chunks[-1].text == expected + "<out:A>"
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].completion_tokens == 12
    assert chunks[-1].prompt_tokens == len(tiny_model.encode("Once upon<in:A>"))
    assert [c.text for c in chunks[:-1]] == [
        "".join(c.delta for c in chunks[: i + 1]) for i in range(len(chunks) - 1)
    ]


def test_stop_event_cancels_and_frees_pages(tiny_model) -> None:
    extensions.load_extensions([])
    scheduler = tiny_model.backend.scheduler
    free_before = scheduler.stats()["free_pages"]
    stop = threading.Event()
    chunks = []
    for chunk in stream_reply("The quick", {**GREEDY, "max_new_tokens": 200}, stop_event=stop):
        chunks.append(chunk)
        stop.set()
    # one token, then the final chunk (no new text) at the next check
    assert [c.finish_reason for c in chunks] == [None, "cancelled"]
    assert chunks[1].text == chunks[0].text and chunks[0].completion_tokens == 1
    stats = scheduler.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["free_pages"] + stats["cached_pages"] >= free_before
    # a stop set before the first token: nothing is generated
    assert list(generate_reply("The quick", GREEDY, stop_event=stop)) == [""]


def test_chat_flow_order(ext_dir: Path, tiny_model) -> None:
    extensions.load_extensions(["alpha", "beta"], ext_dir)
    messages = [{"role": "user", "content": "Hello"}]
    prompt, state = prepare_chat(messages, GREEDY)
    # history_modifier appended two user messages; input_modifier edited the last one;
    # bot_prefix_modifier follows the template's generation prompt.
    expected = tiny_model.apply_chat_template(
        [
            {"role": "user", "content": "Hello"},
            {"role": "user", "content": "from A"},
            {"role": "user", "content": "from B<in:A><in:B>"},
        ],
        add_generation_prompt=True,
    )
    assert prompt == expected + "[A][B]"
    assert state["order"] == "AB" and state["add_bos_token"] is False
    replies = list(generate_chat_reply(messages, GREEDY))
    raw = tiny_model.generate(tiny_model.encode(prompt, add_bos=False), GREEDY)
    assert replies[-1] == raw + "<out:A><out:B>"
    assert messages == [{"role": "user", "content": "Hello"}]  # the caller's list untouched


TGW_PATH = os.environ.get("KESTREL_TGW_PATH")


@pytest.mark.skipif(not TGW_PATH, reason="KESTREL_TGW_PATH (a TGW checkout) is not set")
def test_tgw_extensions_run_unchanged(tmp_path: Path, tiny_model) -> None:
    source = Path(TGW_PATH or "") / "extensions"
    root = tmp_path / "tgw_extensions"
    for name in ("example", "character_bias"):
        shutil.copytree(source / name, root / name)
    try:
        loaded = extensions.load_extensions(["example", "character_bias"], root, strict=True)
        assert [e.name for e in loaded] == ["example", "character_bias"]
        # example: every hook is the identity; character_bias: a one-argument
        # bot_prefix_modifier that adds its bias string.
        prompt, _ = prepare_chat([{"role": "user", "content": "Hi"}], GREEDY)
        template = tiny_model.apply_chat_template(
            [{"role": "user", "content": "Hi"}], add_generation_prompt=True
        )
        assert prompt == template + " *I am so happy* "
        reply = list(generate_reply("Once upon", GREEDY))[-1]
        assert reply == tiny_model.generate("Once upon", GREEDY)
        # the example's imports resolved to the TGW shim, which reaches the current model
        from modules import shared as tgw_shared
        from modules.text_generation import decode, encode

        assert tgw_shared.model is tiny_model and tgw_shared.args is shared.args
        assert decode(encode("Once upon")[0]) == "Once upon"
    finally:
        extensions.load_extensions([])


def test_create_extension_ui_builds_blocks_and_tabs(ext_dir: Path) -> None:
    gr = pytest.importorskip("gradio")
    from webui.extension_ui import create_extension_ui

    _write(ext_dir, "tabbed", 'params = {"is_tab": True, "display_name": "My tab"}\n'
           "import gradio as gr\ndef ui():\n    gr.Markdown('in a tab')\n")  # fmt: skip
    _write(ext_dir, "word_replace", (extensions.DEFAULT_EXTENSIONS_DIR / "word_replace" /
                                     "script.py").read_text())  # fmt: skip
    extensions.load_extensions(["tabbed", "alpha", "word_replace"], ext_dir, strict=True)
    with gr.Blocks() as demo:
        drawn = create_extension_ui()
    # alpha has no ui(); the column comes first, then the tabs
    assert drawn == ["word_replace", "tabbed"]
    config = demo.get_config_file()
    labels = {c["props"].get("label") for c in config["components"]}
    assert {"Replace words", "In the input (old=new; ...)", "My tab"} <= labels
    column = [c for c in config["components"] if c["props"].get("elem_id") == "extensions"]
    assert len(column) == 1
