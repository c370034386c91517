"""The Parameters tab's grammar box (issue 32) in a real browser: a GBNF grammar typed there
constrains the chat reply and the notebook's continuation, and a grammar that does not
compile is an error that names the box's key and where the grammar is wrong, in the chat
and in the notebook. `python ui.py --model tiny-llama` (random weights: only the grammar
makes its text readable) on a fresh user-data folder; headless Chromium."""

from __future__ import annotations

import re

import pytest

from helpers.browser import (
    SLOW,
    bot_messages,
    desktop_context,
    open_page,
    require_browser,
    running_ui,
    send,
    tab,
)
from helpers.model_factory import make_tiny_llama

sync_api = require_browser()
expect = sync_api.expect

pytestmark = pytest.mark.browser
expect.set_options(timeout=SLOW)

GRAMMAR = 'root ::= "The answer is " ("yes" | "no" | "not known") "."\n'
ANSWER = re.compile(r"The answer is (yes|no|not known)\.")
BAD_GRAMMAR = 'root ::= "a" undefined-rule\n'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-grammar")
    make_tiny_llama(root / "models" / "tiny-llama", max_position_embeddings=4096)
    args = [
        "--models-dir", str(root / "models"), "--user-data-dir", str(root / "user_data"),
        "--model", "tiny-llama",
    ]  # fmt: skip
    with running_ui(args, root / "server.log") as url:
        yield url


@pytest.fixture
def page(browser, server):
    with desktop_context(browser) as context:
        yield open_page(context, server)


def _type_grammar(page, text: str) -> None:
    tab(page, "Parameters")
    box = page.locator("#param-grammar_string textarea")
    box.fill(text)
    box.blur()
    expect(box).to_have_value(text)


def _notebook_box(page):
    tab(page, "Notebook")
    box = page.locator("#notebook-text textarea")
    # The page puts the remembered text in before the box is editable, and puts back what
    # was typed if Gradio replays the box's earlier value (webui/notebook_restore.py).
    expect(box).to_be_editable()
    return box


def _fill_notebook(page, box, text: str) -> None:
    """Type `text` once and wait until the server has saved the whole of it."""
    box.fill(text)
    saved = page.locator("#notebook-saved")
    expect(saved).to_contain_text(f"Text saved ({len(text)} characters)")
    expect(box).to_have_value(text)


def test_a_typed_grammar_constrains_the_chat_reply_and_the_notebook(page):
    _type_grammar(page, GRAMMAR)
    tab(page, "Chat")
    send(page, "Is the sky blue?")
    expect(page.locator("#chat-status")).to_contain_text(re.compile(r"tokens.*\bstop\b"))
    expect(bot_messages(page)).to_have_count(1)
    reply = bot_messages(page).last.inner_text().strip()
    assert ANSWER.fullmatch(reply), reply

    box = _notebook_box(page)
    prompt = "Q: Is water wet?\nA: "
    _fill_notebook(page, box, prompt)
    page.click("#notebook-generate")
    expect(page.locator("#notebook-status")).to_contain_text(re.compile(r"tokens.*\bstop\b"))
    expect(box).to_be_enabled()
    written = box.input_value()
    assert written.startswith(prompt) and ANSWER.fullmatch(written[len(prompt) :]), written


def test_an_invalid_grammar_is_an_error_naming_it(page):
    _type_grammar(page, BAD_GRAMMAR)
    tab(page, "Chat")
    send(page, "Is the sky blue?")
    error = page.locator("#chat-error")
    expect(error).to_contain_text("grammar_string")
    expect(error).to_contain_text("undefined-rule")

    box = _notebook_box(page)
    _fill_notebook(page, box, "Q: Is water wet?\nA: ")
    page.click("#notebook-generate")
    status = page.locator("#notebook-status")
    expect(status).to_contain_text("grammar_string")
    expect(status).to_contain_text("undefined-rule")
    expect(box).to_have_value("Q: Is water wet?\nA: ")  # nothing written, nothing lost
