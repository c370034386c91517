"""The web UI in a real browser: `python ui.py` as a user starts it (a subprocess on
loopback, with a tiny random model, a broken model and a PEFT LoRA in temporary folders),
driven by headless Chromium through Playwright.

One server and one browser serve the whole module, and the tests run in file order as one
user's visit would: a load error, then loading from the list, chatting (streaming, stop,
regenerate, continue), parameters and presets, saved chats, two sessions at once, LoRA,
unload. Skipped, saying why, where Chromium or Playwright is missing (CI installs the
Debian `chromium` package in .ci/run).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from helpers.browser import (
    SLOW,
    STOPPABLE_LAYERS,
    bot_messages,
    choose,
    desktop_context,
    open_page,
    require_browser,
    running_ui,
    send,
    set_value,
    status_tokens,
    tab,
)
from helpers.model_factory import make_tiny_llama
from loader.base import LoadedModel
from loader.kestrel_loader import KestrelModel

sync_api = require_browser()
expect = sync_api.expect

pytestmark = pytest.mark.browser
expect.set_options(timeout=SLOW)
LORA_SUPPORTED = KestrelModel.load_lora is not LoadedModel.load_lora


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    models, loras = root / "models", root / "loras"
    model = make_tiny_llama(
        models / "tiny-llama", max_position_embeddings=4096, num_hidden_layers=STOPPABLE_LAYERS
    )
    # A model whose weights file is garbage: listed (it has a config.json), fails to load.
    broken = models / "broken-model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models / "tiny-llama" / name, broken / name)
    (broken / "model.safetensors").write_bytes(b"\x00not a safetensors file")
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    peft_model.save_pretrained(loras / "tiny-lora")
    return {"root": root, "models": models, "loras": loras, "user": root / "user_data"}


@pytest.fixture(scope="module")
def server(dirs):
    args = [
        "--models-dir", str(dirs["models"]), "--loras-dir", str(dirs["loras"]),
        "--user-data-dir", str(dirs["user"]), "--no-default-model",
    ]  # fmt: skip
    with running_ui(args, dirs["root"] / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def page(browser, server):
    with desktop_context(browser) as context:
        yield open_page(context, server)


# -- the visit ------------------------------------------------------------------------------
def test_load_error_is_shown_in_the_page(page):
    tab(page, "Model")
    choose(page, "model-select", "broken-model")
    page.click("#model-load")
    error = page.locator("#model-error")
    expect(error).to_contain_text("could not load broken-model")
    expect(error).to_contain_text("model.safetensors")
    expect(page.locator("#model-status")).not_to_contain_text("Loaded")


def test_load_a_model_from_the_list(page):
    page.click("#model-select input")
    labels = page.locator("[role=option]").all_inner_texts()
    # Sized in the unit that fits (a tiny model is not "0.00 GB").
    assert any(re.search(r"tiny-llama \(fp32, \d+(\.\d)? [KM]B\)", t) for t in labels), labels
    page.locator('[role=option][aria-label^="tiny-llama"]').first.click()
    page.click("#model-load")
    status = page.locator("#model-status")
    expect(status).to_contain_text("Loaded tiny-llama")
    expect(status).to_contain_text("LlamaForCausalLM")
    expect(status).to_contain_text("context 4096 tokens")
    expect(status).to_contain_text("cpu")  # memory per device, with numbers
    expect(status).to_contain_text(re.compile(r"this server uses \d+\.\d\d GiB"))
    tab(page, "Chat")
    page.get_by_text("Chat template (from the model)").click()
    expect(page.locator("#chat-template")).to_contain_text("im_start")


def test_chat_streams_a_reply_and_stop_ends_it(page):
    tab(page, "Parameters")
    set_value(page, "param-max_new_tokens", 3000)
    page.check("#param-ban_eos_token input")
    tab(page, "Chat")
    send(page, "Tell me a long story")
    expect(page.locator("#chatbot .user.message")).to_contain_text("Tell me a long story")
    reply = bot_messages(page).last
    expect(reply).not_to_be_empty()
    first = len(reply.inner_text())
    # Streaming: the same message grows while the status counts tokens.
    page.wait_for_function(
        "n => { const m = document.querySelectorAll('#chatbot .bot.message');"
        " return m.length && m[m.length - 1].innerText.length > n; }",
        arg=first,
    )
    expect(page.locator("#chat-status")).to_contain_text("tok/s")
    page.click("#chat-stop")
    expect(page.locator("#chat-status")).to_contain_text("stopped")
    assert 0 < status_tokens(page.inner_text("#chat-status")) < 3000


def test_a_sampler_change_applies_and_regenerate_continue_work(page):
    tab(page, "Parameters")
    set_value(page, "param-max_new_tokens", 7)
    tab(page, "Chat")
    page.click("#chat-regenerate")
    expect(page.locator("#chat-status")).to_contain_text(re.compile(r"\b7 tokens.*length"))
    assert bot_messages(page).count() == 1  # the stopped reply was replaced, not kept
    before = bot_messages(page).last.inner_text()
    page.click("#chat-continue")
    expect(bot_messages(page).last).not_to_have_text(before)
    expect(page.locator("#chat-status")).to_contain_text(re.compile(r"\b7 tokens.*length"))
    after = bot_messages(page).last.inner_text()
    assert bot_messages(page).count() == 1 and len(after) > len(before)


def test_preset_round_trip_and_settings_are_remembered(page, dirs, server):
    tab(page, "Parameters")
    set_value(page, "param-temperature", 0.55)
    set_value(page, "param-top_k", 33)
    set_value(page, "preset-name", "mine")
    page.click("#preset-save")
    expect(page.locator("#params-status")).to_contain_text("Saved preset mine")
    saved = (dirs["user"] / "presets" / "mine.yaml").read_text()
    assert "temperature: 0.55" in saved and "top_k: 33" in saved
    choose(page, "preset", "Default")
    expect(page.locator("#params-status")).to_contain_text("Preset Default loaded")
    expect(page.locator("#param-temperature input[type=number]")).to_have_value("1")
    expect(page.locator("#param-max_new_tokens input[type=number]")).to_have_value("7")
    choose(page, "preset", "mine")
    expect(page.locator("#param-temperature input[type=number]")).to_have_value("0.55")
    expect(page.locator("#param-top_k input[type=number]")).to_have_value("33")
    # A new page (a reload, or the next start) comes back with the same settings.
    other = open_page(page.context.browser.new_context(), server)
    tab(other, "Parameters")
    expect(other.locator("#param-temperature input[type=number]")).to_have_value("0.55")
    expect(other.locator("#param-max_new_tokens input[type=number]")).to_have_value("7")
    other.close()


def test_chat_is_saved_and_reopened(page, dirs):
    tab(page, "Chat")
    name = page.locator("#chat-name textarea, #chat-name input").first.input_value()
    saved = json.loads((dirs["user"] / "chats" / f"{name}.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    reply = bot_messages(page).last.inner_text()
    page.click("#chat-clear")
    expect(bot_messages(page)).to_have_count(0)
    assert page.locator("#chat-name textarea, #chat-name input").first.input_value() != name
    choose(page, "chat-past", "Tell me a long story")  # listed by its first message
    page.click("#chat-open")
    expect(page.locator("#chat-status")).to_contain_text(f"Opened {name}")
    expect(bot_messages(page).last).to_have_text(reply)
    expect(page.locator("#chatbot .user.message")).to_contain_text("Tell me a long story")


def test_two_sessions_chat_at_once(page, browser, server):
    second = open_page(browser.new_context(), server)
    for p in (page, second):
        tab(p, "Parameters")
        set_value(p, "param-max_new_tokens", 120)
        tab(p, "Chat")
        p.click("#chat-clear")
    send(page, "first user")
    send(second, "second user")
    for p in (page, second):
        expect(p.locator("#chat-status")).to_contain_text(re.compile(r"\b120 tokens.*length"))
    assert "second user" not in page.inner_text("#chatbot")
    assert "first user" not in second.inner_text("#chatbot")
    second.context.close()


def test_lora_panel(page):
    tab(page, "Model")
    choose(page, "lora-available", "tiny-lora")
    page.click("#lora-load")
    status = page.locator("#lora-status")
    if not LORA_SUPPORTED:
        expect(status).to_contain_text("does not load LoRA adapters")
        return
    expect(status).to_contain_text("Applied: tiny-lora × 1")
    set_value(page, "lora-scale", 0.5)
    expect(status).to_contain_text("tiny-lora × 0.5")
    page.click("#lora-unload")
    expect(status).to_contain_text("No LoRA applied")


def test_unload(page):
    tab(page, "Model")
    page.click("#model-unload")
    expect(page.locator("#model-status")).to_contain_text("Unloaded tiny-llama")
    tab(page, "Chat")
    send(page, "anyone there?")
    expect(page.locator("#chat-error")).to_contain_text("Load a model first")
